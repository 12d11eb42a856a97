"""Several machines: two torchrun agents on this machine, started with the line `fivefold train` prints
(`--nnodes 2`), train the same losses as the single launcher; `--slurm` prints an sbatch script for the plan
and exits without training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest

from fivefold.cli import main
from fivefold.local import free_port
from fivefold.spec import plan_from_dict

TRAIN = [sys.executable, "-m", "fivefold", "train"]




def test_slurm_prints_an_sbatch_script_and_does_not_train(tmp_path, capsys, launched, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", "llama3-8b", "--cluster", "4x8xH100-SXM", "--tp", "8", "--seq-len", "4096",
                 "--global-batch", "64", "--steps", "1000", "--lr-schedule", "wsd", "--data", "0.7:web/,0.3:c.jsonl",
                 "--metrics-file", "runs/a/metrics.jsonl", "--slurm"]) == 0
    script = capsys.readouterr().out
    assert not launched and list(tmp_path.iterdir()) == []  # nothing trained, nothing written
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert "#SBATCH --nodes=4" in lines and "#SBATCH --gpus-per-node=8" in lines
    assert "#SBATCH --ntasks-per-node=1  # one torchrun agent per node; it starts the node's workers" in lines
    assert lines[-1] == ('srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 --rdzv-id "$SLURM_JOB_ID" '
                         '--rdzv-backend c10d --rdzv-endpoint "$head_node:29500" -m fivefold train --torchrun-worker '
                         '--plan "$plan_file" --steps 1000 --data 0.7:web/,0.3:c.jsonl --metrics-file '
                         'runs/a/metrics.jsonl --lr-schedule wsd')
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    plan_text = script.split("<<'FIVEFOLD_PLAN'\n")[1].split("\nFIVEFOLD_PLAN\n")[0]
    plan = plan_from_dict(tomllib.loads(plan_text))  # the plan travels inside the script
    assert (plan.dp, plan.tp, plan.world_size, plan.model.name) == (4, 8, 32, "llama3-8b")
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell
    assert main(["train", "--nproc", "2", "--dp", "2", "--slurm"]) == 0  # CPU workers: no GPUs asked for
    assert "--gpus-per-node" not in capsys.readouterr().out


def metrics_losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_two_torchrun_agents_train_the_same_losses_as_one_launcher(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([*TRAIN, "--cluster", "2x1xcpu", "--dp", "2", "--seq-len", "32", "--steps", "2",
                             "--device", "cpu", "--metrics-file", str(tmp_path / "one" / "metrics.jsonl"), "--json"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert single.returncode == 0, single.stderr[-3000:]
    line = next(x for x in single.stderr.splitlines() if x.startswith("on several machines, run on each: "))
    command = line.removeprefix("on several machines, run on each: torchrun ")
    assert command.startswith("--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 ")
    command = command.replace("HOST:29500", f"localhost:{free_port()}").replace(  # agents' rank 0: its own file
        str(tmp_path / "one" / "metrics.jsonl"), str(tmp_path / "two" / "metrics.jsonl"))
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *command.split()],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
              for _ in range(2)]
    for agent in agents:
        _, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err[-3000:]
    one, two = metrics_losses(tmp_path / "one" / "metrics.jsonl"), metrics_losses(tmp_path / "two" / "metrics.jsonl")
    assert len(one) == 2 and two == pytest.approx(one, rel=1e-6)
    assert one[0] == pytest.approx(5.594324, rel=1e-5)  # the step-1 loss of every parity plan
