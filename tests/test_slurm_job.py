"""Training as a Slurm job, on a fake Slurm (tests/fake_slurm.py: two "nodes" as local torchrun agents): the
script `fivefold train --slurm` prints is submitted, SIGTERM reaches its batch shell mid-run (Slurm's
--signal=B:TERM before the time limit), the workers end their step and save it, the script requeues the job,
the requeued job resumes (`--resume auto`) and finishes; its losses are those of an uninterrupted run, W&B got
the scalars TensorBoard got, each rank wrote its profiler trace, and `fivefold report` shows both launches."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from fake_slurm import environment, install
from fivefold.cli import main
from fivefold.local import free_port

pytestmark = pytest.mark.slow
STEPS = 8


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wandb_history(run_file: Path) -> list[dict]:
    """The logged rows of an offline W&B run file: W&B's record log (LevelDB's log format: 32 KiB blocks of
    records, each a 7-byte header (crc, length, type) and a piece of a protobuf Record), its history records."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, rows = run_file.read_bytes(), 7, b"", []  # 7: the ":W&B" header, magic, version
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
        elif kind == 0:
            break
    return rows


def tensorboard_scalars(folder: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for events in sorted(folder.glob("events.out.tfevents.*")):  # one file per launch
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            for point in accumulator.Scalars(tag):
                scalars[(tag, point.step)] = point.value
    return scalars


def job_id_with_free_port() -> int:
    """A job id whose rendezvous port (20000 + id % 40000, runtime/slurm.py) nothing listens on."""
    while True:
        port = free_port()
        if 20000 <= port < 60000:
            return port - 20000


def test_a_preempted_slurm_job_is_requeued_and_trains_the_uninterrupted_losses(tmp_path, monkeypatch, capsys,
                                                                                 dp2_reference):
    monkeypatch.chdir(tmp_path)  # the script runs where it was generated (#SBATCH --chdir)
    run = ["train", "--cluster", "2x1xcpu", "--dp", "2", "--seq-len", "32", "--device", "cpu", "--steps", str(STEPS),
           "--checkpoint-dir", "ck", "--metrics-file", "run/metrics.jsonl", "--tensorboard", "run/tb",
           "--wandb", "fivefold-test", "--profile-steps", "2-3", "--collective-timeout", "120"]
    assert main([*run, "--slurm", "--time", "30:00", "--output", "job-%j.log", "--term-grace", "90"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:TERM@90" in script and "--resume auto" in script
    (tmp_path / "job.sbatch").write_text(script)
    job = job_id_with_free_port()
    env = {**environment(install(tmp_path / "bin"), tmp_path / "slurm", job), "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": "1"}
    env.pop("SLURM_JOB_ID", None)
    sbatch = subprocess.Popen(["sbatch", "job.sbatch"], env=env, stdout=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(read_jsonl(metrics)) >= 3):  # the profiled steps 2-3 are done
            assert time.monotonic() < deadline and sbatch.poll() is None, (tmp_path / f"job-{job}.log").read_text()
            time.sleep(0.1)
        os.kill(int((tmp_path / "slurm" / "batch.pid").read_text()), signal.SIGTERM)  # --signal=B:TERM
        sbatch.communicate(timeout=300)
    finally:
        if sbatch.poll() is None:
            sbatch.kill()
    log = (tmp_path / f"job-{job}.log").read_text()
    assert sbatch.returncode == 0 and (tmp_path / "slurm" / "exit").read_text().strip() == "0", log
    assert f"requeueing job {job}" in log and "(requeued 1 times)" in log

    # SIGTERM saved the step it stopped at: the requeued job ran every later step once, none again.
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), log
    expected = {r["step"]: r["loss"] for r in read_jsonl(dp2_reference / "metrics.jsonl")}
    assert [r["loss"] for r in records] == pytest.approx([expected[s] for s in range(1, STEPS + 1)], rel=1e-6)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    launches = [e for e in events if e["kind"] == "launch"]
    assert [(e["slurm_job_id"], e["slurm_restart_count"]) for e in launches] == [(str(job), 0), (str(job), 1)]
    (term,) = [e for e in events if e["kind"] == "term"]
    stopped = term["step"]
    assert term["saved"] and 3 <= stopped < STEPS
    resumed = next(e for e in events if e["kind"] == "resumed")
    assert resumed["step"] == stopped and resumed["path"].endswith(f"ck/step-{stopped:08d}")

    # W&B (offline, one run across the requeue) got what TensorBoard got.
    run_files = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2 and len({f.name for f in run_files}) == 1  # two launches, one W&B run id
    logged = {(tag, row["train/step"]): value for f in run_files for row in wandb_history(f)
              for tag, value in row.items() if not tag.startswith("_") and tag != "train/step"}
    board = tensorboard_scalars(tmp_path / "run" / "tb")
    assert logged.keys() == board.keys() and {tag for tag, _ in board} >= {"train/loss", "train/lr", "speed/mfu"}
    assert all(logged[key] == pytest.approx(board[key], rel=1e-6) for key in board)
    assert sorted(step for tag, step in board if tag == "train/loss") == list(range(1, STEPS + 1))

    # Each rank's profiler trace of steps 2-3, readable as Chrome trace JSON (what Perfetto opens).
    for rank in (0, 1):
        trace = json.loads((tmp_path / "run" / "profile" / f"rank{rank}-steps2-3.trace.json").read_text())
        marks = {e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
        assert marks == {"ProfilerStep#2", "ProfilerStep#3"}

    # The report: both launches, the SIGTERM and its save, no repeated step, the traces, the curves.
    assert main(["report", "run", "--json"]) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    first, second = training["launches"]
    assert (first["steps"], first["terminated"]["saved"], first["slurm_restart_count"]) == ([1, stopped], True, 0)
    assert (second["steps"], second["resumed_at_step"], second["slurm_restart_count"]) == \
        ([stopped + 1, STEPS], stopped, 1)
    assert training["warnings"] == [] and training["steps"] == [1, STEPS]
    assert training["loss"]["last"] == pytest.approx(expected[STEPS], rel=1e-6)
    assert sorted(Path(p).name for p in training["profiles"]) == ["rank0-steps2-3.trace.json",
                                                                 "rank1-steps2-3.trace.json"]
    assert Path(training["curves"]).stat().st_size > 20_000
