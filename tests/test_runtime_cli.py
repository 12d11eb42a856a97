"""`fivefold train` end to end: bad plans stop before any process starts; a real run writes the
metrics file, the plan next to it, a JSON summary and a torchrun line that works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fivefold.cli import main
from fivefold.runtime.launch import free_port
from fivefold.cost.flops import model_flops_per_step
from fivefold.runtime.metrics import METRIC_FIELDS
from fivefold.runtime.optim import lr_at
from fivefold.spec import load_plan

ROOT = Path(__file__).resolve().parents[1]
FIVEFOLD = [sys.executable, "-m", "fivefold"]


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything tries to start worker processes."""
    import torch.distributed.launcher.api as launcher_api

    def refuse(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(launcher_api, "elastic_launch", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "1x4xcpu", "--tp", "4"], "error: plan.tp=4: must divide model.kv_heads=2; valid: 1, 2"),
    (["--cluster", "1x2xcpu", "--pp", "2", "--layers-per-stage", "1,2"],
     "error: plan.layers_per_stage=[1, 2]: sums to 3 but model.layers=4"),
    (["--cluster", "1x4xcpu", "--nproc", "2"],
     "error: --nproc=2: the plan needs dp*tp*pp*cp = 4 processes on 1x4xcpu (dp4 tp1 pp1 mb1x2 zero0 rc=none), "
     "not 2; give --nproc 4, or --cluster 1x2xcpu --dp 2 for 2 CPU workers"),
    (["--cluster", "1x2xcpu", "--dp", "1", "--tp", "1"],
     "error: plan.dp*tp*pp*cp=1: degrees must multiply to the cluster's 2 devices (dp=1 tp=1 pp=1 cp=1); "
     "e.g. dp=2"),
])
def test_bad_plan_stops_with_one_line(no_launch, capsys, argv, message):
    assert main(["train", "--device", "cpu", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == message
    assert out == ""


def test_bad_plan_file_stops_with_one_line(no_launch, capsys, tmp_path):
    good = tmp_path / "plan.toml"
    assert main(["train", "--cluster", "1x2xcpu", "--seq-len", "32", "--steps", "1", "--device", "cpu",
                 "--nproc", "3"]) == 2  # nothing written: fails first
    capsys.readouterr()
    from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

    Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x2xcpu"), train=TrainSpec(seq_len=32), dp=2).save(good)
    bad = tmp_path / "bad.toml"
    bad.write_text(good.read_text().replace("dp = 2", "dp = 3"))
    assert main(["train", "--plan", str(bad), "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == ("error: plan.dp*tp*pp*cp=3: degrees must multiply to the "
                                               "cluster's 2 devices (dp=3 tp=1 pp=1 cp=1); e.g. dp=2")


@pytest.mark.slow
def test_train_two_processes_writes_metrics_plan_and_summary(tmp_path):
    run = tmp_path / "run"
    result = subprocess.run(
        [*FIVEFOLD, "train", "--cluster", "1x2xcpu", "--dp", "2", "--zero", "1", "--seq-len", "32", "--steps", "3",
         "--lr", "2e-3", "--warmup-steps", "1", "--device", "cpu", "--metrics-file", str(run / "metrics.jsonl"),
         "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)  # stdout holds only the JSON summary
    assert summary["world_size"] == 2 and summary["steps"] == 3 and summary["plan"].startswith("dp2 ")
    assert "torchrun --nnodes 1 --nproc-per-node 2" in result.stderr
    assert f"--plan {run / 'plan.toml'}" in result.stderr

    plan = load_plan(run / "plan.toml")
    assert (plan.dp, plan.zero, plan.train.seq_len) == (2, 1, 32)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    flops = model_flops_per_step(plan.model, plan.train)
    for r in records:
        assert set(METRIC_FIELDS) <= set(r)
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, 2e-3, 1, 3))
        assert r["tokens"] == 256 * r["step"]
        assert r["tokens_per_s"] == pytest.approx(256 / r["step_time_s"])
        assert r["mfu"] == pytest.approx(flops / (r["step_time_s"] * 2 * 100e9), rel=1e-9)  # 2 cpu placeholders
        assert 0.05 < r["peak_memory_gib"] < 8
    assert [r["loss"] for r in records] == summary["losses"]
    assert records[0]["loss"] == pytest.approx(5.594324, rel=1e-5)  # same as every parity plan at step 1


@pytest.mark.slow
def test_printed_torchrun_command_runs(tmp_path):
    from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

    plan_file = tmp_path / "plan.toml"
    Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x1xcpu"), train=TrainSpec(seq_len=32, dtype="fp32")
         ).save(plan_file)
    from fivefold.runtime import torchrun_command

    command = torchrun_command(str(plan_file), ["--steps", "2", "--device", "cpu"], 1, 1)
    command = command.replace("HOST:29500", f"localhost:{free_port()}").replace("torchrun ", "", 1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", *command.split(), "--json"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["steps"] == 2 and summary["losses"][0] == pytest.approx(5.594324, rel=1e-5)


@pytest.mark.slow
def test_worker_failure_is_one_line_exit_1(tmp_path):
    # Token ids beyond the vocabulary are now refused before launch (tests/test_bad_inputs.py); a fault only a
    # worker meets: the loss-injection knob, malformed, raises inside the worker.
    env = {**os.environ, "FIVEFOLD_INJECT_LOSS": "bogus"}
    result = subprocess.run(
        [*FIVEFOLD, "train", "--cluster", "1x1xcpu", "--seq-len", "32", "--steps", "1", "--device", "cpu"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: worker rank 0 failed (exit code 1): SpecError: FIVEFOLD_INJECT_LOSS='bogus'")
    assert last.endswith("(FIVEFOLD_DEBUG=1 shows the traceback)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_one_gpu(tmp_path):
    result = subprocess.run(
        [*FIVEFOLD, "train", "--cluster", "1x1xH100", "--seq-len", "128", "--steps", "5", "--device", "cuda",
         "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["device"] == "cuda" and summary["losses"][-1] < summary["losses"][0]
