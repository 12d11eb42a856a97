"""`fivefold train ... --slurm`: an sbatch script for the plan, printed instead of training.

One task per node runs torchrun (the agent), which starts the node's workers; the rendezvous comes from SLURM's
variables: the first host of $SLURM_JOB_NODELIST is the c10d endpoint, $SLURM_JOB_ID the rendezvous id, and
$SLURM_NNODES the node count. The plan travels inside the script (written next to it at run time), so the
script alone is the job; every worker then runs `fivefold train --torchrun-worker` with the run's flags and
checks them exactly as on one machine.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

from fivefold.spec import Plan

RDZV_PORT = 29500


def print_slurm_script(plan: Plan, config: Any) -> int:
    """`--slurm`: the script on stdout, for the plan's nodes and the run's flags (RunConfig.to_flags); exit 0."""
    from fivefold.runtime.launch import nodes_of

    sys.stdout.write(slurm_script(plan, config.to_flags(), *nodes_of(plan)))
    return 0


def slurm_script(plan: Plan, run_flags: list[str], nodes: int, per_node: int) -> str:
    """The sbatch script of `plan` on `nodes` nodes of `per_node` workers, with the run's `train` flags."""
    gpus = any(group.device.name != "cpu" for group in plan.cluster.groups)
    worker = " ".join(shlex.quote(flag) for flag in run_flags)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=fivefold-{plan.model.name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1  # one torchrun agent per node; it starts the node's workers",
        *([f"#SBATCH --gpus-per-node={per_node}"] if gpus else []),
        "#SBATCH --exclusive",
        "set -euo pipefail",
        f"# plan: {plan.describe()} on {plan.cluster.label} ({plan.world_size} workers)",
        'plan_file="fivefold-plan-${SLURM_JOB_ID}.toml"',
        "cat > \"$plan_file\" <<'FIVEFOLD_PLAN'",
        plan.to_toml().rstrip("\n"),
        "FIVEFOLD_PLAN",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {per_node} --rdzv-id "$SLURM_JOB_ID" '
        f'--rdzv-backend c10d --rdzv-endpoint "$head_node:{RDZV_PORT}" -m fivefold train --torchrun-worker '
        f'--plan "$plan_file"' + (f" {worker}" if worker else ""),
    ]
    return "\n".join(lines) + "\n"
