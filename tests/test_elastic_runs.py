"""Fault tolerance with real worker processes (CPU, gloo, fp32, the tiny model):

- a worker killed with SIGKILL mid-run: the group restarts, resumes from the newest complete checkpoint,
  and every step after the recovery has exactly the loss of an uninterrupted run;
- shrinking 2 -> 1 processes and growing back 1 -> 2 with --resume: re-planned, resharded, losses within 1e-5;
- the loss guard: injected NaN/Inf skip updates, 3 in a row roll back, a spike is skipped;
- a slow rank is reported as a straggler with its rank and host;
- a rank that stops participating ends the run with one line naming the collective timeout.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fivefold.cli import main

RUN = ["train", "--seq-len", "32", "--device", "cpu"]
STEPS = 8


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses_by_step(metrics: Path) -> dict[int, float]:
    """The loss of each step's last run (a step run again after a recovery replaces its first run)."""
    return {r["step"]: r["loss"] for r in read_jsonl(metrics)}


@pytest.fixture
def reference(dp2_reference) -> Path:
    """An uninterrupted 2-process run (dp2) of 8 steps, saving every 2 steps (conftest.py)."""
    return dp2_reference


def test_killed_worker_is_restarted_and_the_losses_continue_exactly(reference, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    command = [sys.executable, "-m", "fivefold", *RUN, "--cluster", "1x2xcpu", "--steps", str(STEPS),
               "--metrics-file", str(metrics), "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
               "--max-restarts", "1", "--collective-timeout", "60"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        # kill once step 4 is done and a checkpoint is complete (the step-2 save commits in the background)
        while not (metrics.exists() and any(r["step"] >= 4 for r in read_jsonl(metrics))
                   and (tmp_path / "ck" / "step-00000002" / "COMMIT").exists()):
            assert time.monotonic() < deadline and proc.poll() is None, "the run did not reach step 4"
            time.sleep(0.02)
        victim = int((tmp_path / "pids" / "rank1").read_text())
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    steps = [r["step"] for r in read_jsonl(metrics)]
    resumed_at = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])  # the first repeated step
    assert steps[resumed_at:] == list(range(steps[resumed_at], STEPS + 1)) and steps[resumed_at] in (3, 5, 7)
    assert losses_by_step(metrics) == losses_by_step(reference / "metrics.jsonl")  # exact, every step
    report = json.loads((tmp_path / "recovery.json").read_text())
    (failure,) = report["failures"]
    assert (failure["kind"], failure["rank"], failure["resumed_at_step"]) == ("killed", 1, steps[resumed_at] - 1)
    assert all(failure["seconds"][part] >= 0 for part in ("detection", "restart", "reload", "recomputed_steps"))
    assert 0 < report["effective_training_time_ratio"] < 1
    assert f"failure: killed on rank 1 at step {failure['step']}" in out


def test_shrink_to_one_process_and_grow_back(reference, tmp_path, capsys):
    """Steps 5-6 on 1 process from the 2-process run's step 4, then steps 7-8 on 2 processes again (the
    1-process run goes on to step 8 with the same LR schedule; its step-8 checkpoint is set aside)."""
    ck = tmp_path / "ck"
    shutil.copytree(reference / "ck" / "step-00000004", ck / "step-00000004")
    code = main([*RUN, "--cluster", "1x2xcpu", "--nproc", "1", "--steps", "8", "--checkpoint-dir", str(ck),
                 "--checkpoint-every", "2", "--resume", "--metrics-file", str(tmp_path / "one" / "metrics.jsonl")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert ("world size 2 -> 1: re-planned dp2 -> dp1 (more accumulation: 4 -> 8 micro-batches), "
            "global batch 8 kept") in out
    shutil.rmtree(ck / "step-00000008")
    code = main([*RUN, "--cluster", "1x1xcpu", "--nproc", "2", "--steps", "8", "--checkpoint-dir", str(ck),
                 "--resume", "--metrics-file", str(tmp_path / "two" / "metrics.jsonl")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "world size 1 -> 2: re-planned dp1 -> dp2 (less accumulation: 8 -> 4 micro-batches)" in out
    expected = losses_by_step(reference / "metrics.jsonl")
    one, two = losses_by_step(tmp_path / "one" / "metrics.jsonl"), losses_by_step(tmp_path / "two" / "metrics.jsonl")
    assert sorted(one) == [5, 6, 7, 8] and sorted(two) == [7, 8]
    got = {5: one[5], 6: one[6], 7: two[7], 8: two[8]}
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5)


def test_loss_guard_skips_rolls_back_and_keeps_training(tmp_path, monkeypatch, capfd):
    # batches 3, 4, 5 bad (NaN, Inf, NaN loss): steps 3-5 skip their update, then roll back to step 4's
    # checkpoint (saved while skipping: the weights of step 2) and skip batch 5; batch 9 is a x50 spike.
    monkeypatch.setenv("FIVEFOLD_INJECT_LOSS", "3:nan,4:inf,5:nan,9:x50")
    metrics = tmp_path / "metrics.jsonl"
    code = main([*RUN, "--cluster", "1x1xcpu", "--steps", "10", "--metrics-file", str(metrics),
                 "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2", "--max-bad-steps", "3"])
    out = capfd.readouterr().out  # the workers' lines come from their processes
    assert code == 0, out
    report = json.loads((tmp_path / "recovery.json").read_text())
    # global batch 8: batch n starts at sample 8 (n - 1); after the rollback step 8 draws batch 9
    assert [(b["step"], b["position"]) for b in report["skipped_steps"]] == [(3, 16), (4, 24), (5, 32), (8, 64)]
    assert [b["reason"] for b in report["skipped_steps"][:3]] == ["loss is nan", "loss is inf", "loss is nan"]
    assert report["skipped_steps"][3]["reason"].startswith("loss ") and "x the running median" in \
        report["skipped_steps"][3]["reason"]
    (rollback,) = report["rollbacks"]
    assert (rollback["step"], rollback["to_step"], rollback["skipped_positions"]) == (5, 4, [16, 24, 32])
    final = {r["step"]: r for r in read_jsonl(metrics)}
    assert sorted(final) == list(range(1, 11))
    assert [s for s, r in final.items() if r["skipped"]] == [3, 4, 8]  # step 5's last run trained batch 6
    assert all(math.isfinite(r["loss"]) for s, r in final.items() if s not in (3, 4))
    assert final[10]["loss"] < final[1]["loss"]
    assert "loss guard: step 3 (batch at sample 16): loss is nan; update skipped (1 bad in a row" in out
    assert "loss guard: 3 bad steps in a row up to step 5: rolled back to step 4" in out


def test_a_slow_rank_is_reported_with_its_rank_and_host(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("FIVEFOLD_SLOW_DEVICES", "1:4")  # rank 1's blocks take 4x as long
    code = main([*RUN, "--cluster", "1x2xcpu", "--steps", "5", "--metrics-file", str(tmp_path / "metrics.jsonl"),
                 "--straggler-factor", "1.5", "--straggler-patience", "3"])
    out = capfd.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "recovery.json").read_text())
    (found,) = report["stragglers"]
    assert (found["rank"], found["host"], found["steps"]) == (1, socket.gethostname(), 3)
    assert found["ratio"] > 2.0
    assert f"straggler: rank 1 on host {socket.gethostname()} computes" in out


def test_a_hung_rank_ends_the_run_with_the_timeout(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FIVEFOLD_HANG_AT", "1:3")  # rank 1 sleeps forever at the start of step 3
    started = time.monotonic()
    code = main([*RUN, "--cluster", "1x2xcpu", "--steps", "6", "--metrics-file", str(tmp_path / "metrics.jsonl"),
                 "--collective-timeout", "3"])
    seconds = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        "error: worker rank 0 failed (exit code 1): CollectiveTimeout: collective timed out after 3 s "
        "(--collective-timeout) at step 3 on rank 0: a peer rank stopped participating (hung, deadlocked or far "
        "slower); raise --collective-timeout if it was only slow (FIVEFOLD_DEBUG=1 shows the traceback)")
    assert seconds < 3 + 30  # the timeout plus start-up and the launcher's slack, not a hang
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
