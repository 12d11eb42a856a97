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
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(["train", "--model", "llama3-8b", "--cluster", "4x8xH100-SXM", "--tp", "8", "--seq-len", "4096",
                 "--global-batch", "64", "--steps", "1000", "--lr-schedule", "wsd", "--data", "0.7:web/,0.3:c.jsonl",
                 "--metrics-file", "runs/a/metrics.jsonl", "--checkpoint-dir", "ck", "--checkpoint-every", "100",
                 "--max-restarts", "2", "--term-grace", "300", "--slurm", "--time", "2-00:00:00",
                 "--partition", "h100", "--account", "proj-7", "--output", "logs/%j.out"]) == 0
    captured = capsys.readouterr()
    script = captured.out
    assert not launched and list(tmp_path.iterdir()) == []  # nothing trained, nothing written
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --time=2-00:00:00",
                 "#SBATCH --partition=h100", "#SBATCH --account=proj-7", "#SBATCH --output=logs/%j.out",
                 f"#SBATCH --chdir={tmp_path}", "export OMP_NUM_THREADS=2",
                 "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300  # torchrun waits this long for its workers to save",
                 "#SBATCH --ntasks-per-node=1  # one torchrun agent per node; it starts the node's workers",
                 "#SBATCH --cpus-per-task=25  # 8 worker(s) x (2 thread(s) + the checkpoint writer) + the agent",
                 "#SBATCH --requeue  # a preempted or timed-out job goes back in the queue and resumes",
                 "#SBATCH --signal=B:TERM@300  # SIGTERM to this script 300 s before the time limit",
                 "rdzv_port=$(( 20000 + SLURM_JOB_ID % 40000 ))  # two jobs on one node do not collide",
                 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 '  scontrol requeue "$SLURM_JOB_ID" || true  # a preempted job may be requeued already'):
        assert line in lines, line
    assert any(line.startswith(("source ", "export PATH=")) and "the environment of `fivefold`" in line
               for line in lines)
    assert (f'srun --kill-on-bad-exit=1 {sys.executable} -m fivefold.elastic.torchrun --nnodes "$SLURM_NNODES" '
            '--nproc-per-node 8 --max-restarts 2 --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint '
            '"$head_node:$rdzv_port" -m fivefold train --torchrun-worker --plan "$plan_file" --steps 1000 --data '
            '0.7:web/,0.3:c.jsonl --metrics-file runs/a/metrics.jsonl --checkpoint-dir ck --checkpoint-every 100 '
            '--term-grace 300 --lr-schedule wsd --resume auto &') in lines
    plan_text = script.split("<<'FIVEFOLD_PLAN'\n")[1].split("\nFIVEFOLD_PLAN\n")[0]
    plan = plan_from_dict(tomllib.loads(plan_text))  # the plan travels inside the script
    assert (plan.dp, plan.tp, plan.world_size, plan.model.name) == (4, 8, 32, "llama3-8b")
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell
    # CPU workers: no GPUs asked for; no checkpoint folder: nothing to resume from, so no requeue, and a warning.
    assert main(["train", "--nproc", "2", "--dp", "2", "--slurm"]) == 0
    captured = capsys.readouterr()
    assert "--gpus-per-node" not in captured.out and "--requeue" not in captured.out
    assert "--resume" not in captured.out and "scontrol requeue" not in captured.out
    assert captured.err.startswith("warning: no --checkpoint-dir: a preempted or timed-out job could not continue")


@pytest.mark.parametrize("flags, message", [
    (["--time", "5"], "--time='5': is passed to sbatch: it goes with --slurm"),
    (["--slurm", "--time", "1:2:3:4"], "--time='1:2:3:4': use one of Slurm's forms: MINUTES, MINUTES:SECONDS, "
                                       "HH:MM:SS, DAYS-HH, DAYS-HH:MM, DAYS-HH:MM:SS (e.g. 2-00:00:00)"),
    (["--slurm", "--partition", "gpu queue"], "--partition='gpu queue': a Slurm partition name (letters, digits, "
                                              "'_', '.', '+', '-')"),
    (["--slurm", "--term-grace", "0"], "--term-grace=0: must be whole seconds from 1 to 65535 (Slurm's --signal "
                                       "limit)"),
])
def test_bad_slurm_flags_are_one_line(tmp_path, capsys, launched, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--nproc", "1", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {message}\n" and captured.out == "" and not launched
    assert list(tmp_path.iterdir()) == []


def metrics_losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_two_torchrun_agents_train_the_same_losses_as_one_launcher(tmp_path, capsys, launched, dp2_reference):
    """The line `train` prints (taken without training: `launched`), run by two torchrun agents; their losses are
    the single launcher's (conftest.py dp2_reference: the same dp2 plan on one machine, whose first two steps do
    not depend on the steps after them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert main(["train", "--cluster", "2x1xcpu", "--dp", "2", "--seq-len", "32", "--steps", "2", "--device", "cpu",
                 "--metrics-file", str(tmp_path / "two" / "metrics.jsonl"), "--json"]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("on several machines, run on each: "))
    command = line.removeprefix("on several machines, run on each: torchrun ")
    assert command.startswith("--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 ")
    command = command.replace("HOST:29500", f"localhost:{free_port()}")
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *command.split()],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
              for _ in range(2)]
    for agent in agents:
        _, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err[-3000:]
    one, two = metrics_losses(dp2_reference / "metrics.jsonl")[:2], metrics_losses(tmp_path / "two" / "metrics.jsonl")
    assert len(two) == 2 and two == pytest.approx(one, rel=1e-6)
    assert one[0] == pytest.approx(5.594324, rel=1e-5)  # the step-1 loss of every parity plan
