"""`fivefold train ... --slurm`: an sbatch script for the plan, printed instead of training.

One task per node runs torchrun (the agent, elastic/torchrun.py: torch's, with one line instead of a traceback
when SIGTERM stops it), which starts the node's workers; the rendezvous comes from Slurm's
variables: the first host of $SLURM_JOB_NODELIST is the c10d endpoint, $SLURM_JOB_ID the rendezvous id and the
source of its port, and $SLURM_NNODES the node count. The plan travels inside the script (written next to it at
run time), so the script alone is the job; every worker then runs `fivefold train --torchrun-worker` with all
of the run's flags and checks them exactly as on one machine.

A cluster job is stopped by its time limit or by preemption, so the script is one command for the first run
and every requeue: `--resume auto` (added when a checkpoint folder is given) starts fresh or continues from the
newest complete checkpoint; `--requeue` and `--signal=B:TERM@<--term-grace>` let Slurm put the job back and warn
this script before the time limit; the script passes SIGTERM on to srun (its torchrun agents pass it to the
workers, which end their step and save: runtime/preemption.py) and, when the run did not finish, requeues the
job itself (Slurm requeues a preempted job on its own; a timed-out one only when asked).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from fivefold.spec import Plan

RDZV_PORT_BASE = 20000  # ports BASE .. BASE + RDZV_PORT_SPAN - 1, picked by the job id
RDZV_PORT_SPAN = 40000
AGENT_CORES = 1  # the torchrun agent of each node
WRITER_CORES = 1  # per worker besides its compute threads: the background checkpoint writer


def print_slurm_script(plan: Plan, config: Any, args: argparse.Namespace) -> int:
    """`--slurm`: the script on stdout, for the plan's nodes and the run's flags (RunConfig.to_flags); exit 0."""
    from fivefold.runtime.launch import nodes_of

    flags = config.to_flags()
    if config.checkpoint_dir is None:
        print("warning: no --checkpoint-dir: a preempted or timed-out job could not continue, so the script does "
              "not requeue it; add --checkpoint-dir DIR (and --checkpoint-every K) to make it resumable",
              file=sys.stderr)
    elif not config.resume:
        flags += ["--resume", "auto"]
    sbatch = {name: getattr(args, name, None) for name in ("time", "partition", "account", "output")}
    sys.stdout.write(slurm_script(plan, flags, *nodes_of(plan), max_restarts=args.max_restarts,
                                  term_grace=config.term_grace, requeue=config.checkpoint_dir is not None,
                                  sbatch=sbatch))
    return 0


def environment_lines() -> list[str]:
    """Shell lines that put a job in the Python environment this script is generated from: its virtual
    environment (or conda prefix), and the PYTHONPATH of a source checkout."""
    prefix = Path(sys.prefix)
    lines = []
    if (prefix / "bin" / "activate").is_file():
        lines.append(f"source {shlex.quote(str(prefix / 'bin' / 'activate'))}  # the environment of `fivefold`")
    else:
        lines.append(f"export PATH={shlex.quote(str(prefix / 'bin'))}:\"$PATH\"  # the environment of `fivefold`")
    if os.environ.get("PYTHONPATH"):
        lines.append(f"export PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])}")
    return lines


def slurm_script(plan: Plan, run_flags: list[str], nodes: int, per_node: int, max_restarts: int = 0,
                 term_grace: int = 120, requeue: bool = True, sbatch: dict[str, str | None] | None = None) -> str:
    """The sbatch script of `plan` on `nodes` nodes of `per_node` workers, with the run's `train` flags."""
    gpus = any(group.device.name != "cpu" for group in plan.cluster.groups)
    threads = int(os.environ.get("OMP_NUM_THREADS") or 1)  # each worker's compute threads
    cores = per_node * (threads + WRITER_CORES) + AGENT_CORES
    worker = " ".join(shlex.quote(flag) for flag in run_flags)
    passed = [f"#SBATCH --{name}={value}" for name, value in (sbatch or {}).items() if value]
    torchrun = (f'srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} -m fivefold.elastic.torchrun '
                f'--nnodes "$SLURM_NNODES" --nproc-per-node {per_node}'
                + (f" --max-restarts {max_restarts}" if max_restarts else "")
                + ' --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head_node:$rdzv_port" '
                  '-m fivefold train --torchrun-worker --plan "$plan_file"' + (f" {worker}" if worker else ""))
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=fivefold-{plan.model.name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1  # one torchrun agent per node; it starts the node's workers",
        *([f"#SBATCH --gpus-per-node={per_node}"] if gpus else []),
        f"#SBATCH --cpus-per-task={cores}  # {per_node} worker(s) x ({threads} thread(s) + the checkpoint writer) "
        "+ the agent",
        "#SBATCH --exclusive",
        *(["#SBATCH --requeue  # a preempted or timed-out job goes back in the queue and resumes"] if requeue else []),
        f"#SBATCH --signal=B:TERM@{term_grace}  # SIGTERM to this script {term_grace} s before the time limit",
        "#SBATCH --open-mode=append  # a requeued job adds to its log",
        f"#SBATCH --chdir={shlex.quote(os.getcwd())}",
        *passed,
        "set -uo pipefail",
        f"# plan: {plan.describe()} on {plan.cluster.label} ({plan.world_size} workers)",
        *environment_lines(),
        f"export OMP_NUM_THREADS={threads}",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={term_grace}  # torchrun waits this long for its workers to save",
        'plan_file="fivefold-plan-${SLURM_JOB_ID}.toml"',
        "cat > \"$plan_file\" <<'FIVEFOLD_PLAN'",
        plan.to_toml().rstrip("\n"),
        "FIVEFOLD_PLAN",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"rdzv_port=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN} ))  # two jobs on one node do not collide",
        'echo "fivefold: job $SLURM_JOB_ID (requeued ${SLURM_RESTART_COUNT:-0} times) on $SLURM_NNODES node(s), '
        'rendezvous $head_node:$rdzv_port" >&2',
        "terminated=0",
        "trap 'terminated=1; kill -TERM \"$srun_pid\" 2>/dev/null' TERM  # on to srun, its agents, the workers",
        torchrun + " &",
        "srun_pid=$!",
        'wait "$srun_pid"; status=$?',
        'while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid"; status=$?; done  # the workers save first',
    ]
    if requeue:
        lines += [
            'if [ "$terminated" = 1 ] && [ "$status" -ne 0 ]; then',
            '  echo "fivefold: stopped by SIGTERM; requeueing job $SLURM_JOB_ID to resume from its newest '
            'checkpoint" >&2',
            '  scontrol requeue "$SLURM_JOB_ID" || true  # a preempted job may be requeued already',
            "fi",
        ]
    lines.append('exit "$status"')
    return "\n".join(lines) + "\n"
