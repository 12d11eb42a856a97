"""Ctrl-C and SIGTERM stop `train`, `profile` and a long `plan` cleanly: one line, exit 130 / 143, no traceback,
no process left, and a checkpoint folder in which every committed checkpoint is whole."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fivefold.checkpoint import checkpoint_problem
from fivefold.elastic.events import read_pids

pytestmark = pytest.mark.slow
SMALL = ["--model", "tiny", "--seq-len", "32", "--global-batch", "4", "--device", "cpu"]


def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    # A session of its own, as a terminal's foreground job: killpg reaches the launcher and its workers. Not
    # under Slurm: SIGTERM saves again only there by default (--save-on-term-within).
    env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
    return subprocess.Popen([sys.executable, "-m", "fivefold", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)


def wait_for(condition, seconds: float = 240.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the run did not get that far"
        time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def interrupt(process: subprocess.Popen, ready, signum: int = signal.SIGINT, whole_group: bool = True,
              out: list | None = None) -> str:
    """Wait until `ready()` (or the process ended), send `signum` (to the process group, as a terminal's Ctrl-C
    does, or to the launcher alone), and return its stderr (its stdout into `out`); the group is killed if it
    outlives the test."""
    try:
        wait_for(lambda: ready() or process.poll() is not None)
        if whole_group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=120)
        if out is not None:
            out.append(stdout)
        return stderr
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("signum, code, whole_group, nproc", [(signal.SIGTERM, 143, False, 2),
                                                              (signal.SIGINT, 130, True, 1)])
def test_interrupted_training_stops_every_worker_and_names_the_newest_checkpoint(tmp_path, signum, code,
                                                                                  whole_group, nproc):
    metrics = tmp_path / "run" / "metrics.jsonl"
    tokenizer = []
    if signum == signal.SIGTERM:  # checkpoints carry the run's tokenizer
        from tokenizers import Tokenizer, models, pre_tokenizers

        hf = Tokenizer(models.WordLevel({"<unk>": 0, **{f"w{i}": i for i in range(1, 300)}}, unk_token="<unk>"))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        hf.save(str(tmp_path / "tokenizer.json"))
        tokenizer = ["--tokenizer", "tokenizer.json"]
    process = start(["train", "--nproc", str(nproc), "--dp", str(nproc), "--steps", "100000", *SMALL, *tokenizer,
                     "--checkpoint-dir", "ck", "--checkpoint-every", "1", "--metrics-file", "run/metrics.jsonl"],
                    tmp_path)
    workers: dict = {}

    def saved_once() -> bool:  # by step 3, step 1's save is committed (a save first waits for the one before)
        if lines(metrics) < 3:
            return False
        workers.update(read_pids(tmp_path / "run"))
        return True

    # whole_group: Ctrl-C in a terminal, every process of the foreground group gets SIGINT
    out: list[str] = []
    err = interrupt(process, saved_once, signum, whole_group, out)
    assert len(workers) == nproc
    assert process.returncode == code, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    match = re.fullmatch(r"interrupted at step (\d+); newest complete checkpoint ck/step-(\d{8})", last)
    assert match, last
    step, saved = int(match.group(1)), int(match.group(2))
    assert 1 <= saved < step and step >= 3
    if signum == signal.SIGTERM:  # the workers ended their step and finished its save, which was in flight
        assert saved == step - 1
        assert f"SIGTERM: stopping after step {saved}; finished the save of step {saved} in flight" in out[0], out[0]
        checkpoint = tmp_path / "ck" / f"step-{saved:08d}"
        assert (checkpoint / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    wait_for(lambda: not any(alive(pid) for pid in workers.values()), 30)
    for folder in (tmp_path / "ck").glob("step-*"):  # whole, or visibly incomplete (no COMMIT): never half
        assert not (folder / "COMMIT").exists() or checkpoint_problem(folder) is None
    assert checkpoint_problem(tmp_path / "ck" / f"step-{saved:08d}") is None


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="inductor needs a C compiler")
def test_ctrl_c_during_compiled_training_prints_nothing_after_the_line(tmp_path):
    """torch.fx's compile progress bar takes tqdm's multiprocessing lock, a semaphore that a stopped worker would
    leave for Python's resource tracker to warn about after the interrupt line; runtime/parallelize.py
    apply_compile gives tqdm a thread lock instead."""
    metrics = tmp_path / "run" / "metrics.jsonl"
    process = start(["train", "--nproc", "1", "--steps", "100000", "--compile", *SMALL,
                     "--metrics-file", "run/metrics.jsonl"], tmp_path)
    err = interrupt(process, lambda: lines(metrics) >= 2)
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("interrupted at step"), err
    assert "Warning" not in err and "leaked" not in err and "Traceback" not in err, err


def test_interrupted_profile_leaves_no_process_and_no_file(tmp_path):
    process = start(["profile", "--quick", "--nproc", "2", "--out", "here.toml"], tmp_path)
    children: list[int] = []

    def measuring() -> bool:
        time.sleep(8)  # past start-up, into the measurements
        children.extend(int(pid) for pid in subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True,
                                                           text=True).stdout.split())
        return True

    err = interrupt(process, measuring)
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("interrupted") and "Traceback" not in err
    assert not (tmp_path / "here.toml").exists()
    wait_for(lambda: not any(alive(pid) for pid in children), 30)


def test_sigterm_during_a_long_plan_search(tmp_path):
    # ~13 s of search on one core (220,000 candidates); stopped once it reports progress
    process = start(["plan", "--model", "gpt-1t", "--cluster", "3000x8xH100", "--seq-len", "2048",
                     "--global-batch", "6000", "--out", "best.toml"], tmp_path)
    try:
        assert process.stderr.readline().startswith("searching: ")
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert not (tmp_path / "best.toml").exists()
