"""The commands a newcomer types just work: `train --nproc N` with no --cluster, output folders created on the
way, TensorBoard scalars that read back equal to the metrics file, and a resume past a corrupted newest
checkpoint that later saves that step again without failing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fivefold.checkpoint import checkpoint_problem
from fivefold.cli import main

pytestmark = pytest.mark.slow
SMALL = ["--model", "tiny", "--seq-len", "32", "--global-batch", "4", "--device", "cpu"]


def test_two_workers_without_cluster_create_their_folders_and_write_tensorboard(tmp_path, capsys):
    metrics = tmp_path / "runs" / "a" / "metrics.jsonl"
    board = tmp_path / "boards" / "a"
    checkpoints = tmp_path / "ck" / "a"
    assert main(["train", "--nproc", "2", "--dp", "2", "--steps", "3", *SMALL, "--metrics-file", str(metrics),
                 "--tensorboard", str(board), "--checkpoint-dir", str(checkpoints),
                 "--metrics-every", "1"]) == 0  # per-rank lists on every step, not every 10th
    out = capsys.readouterr().out
    assert "done: 3 steps of dp2 tp1 pp1" in out
    assert checkpoint_problem(checkpoints / "step-00000003") is None
    records = [json.loads(line) for line in metrics.read_text().splitlines()]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(board))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/grad_norm", "train/lr", "speed/tokens_per_s", "speed/mfu", "speed/step_time_s",
                "memory/peak_gib", "step_time_per_rank/rank_0", "step_time_per_rank/rank_1",
                "memory_per_rank/rank_0", "memory_per_rank/rank_1", "train/skipped"}
    assert expected <= tags
    for tag, key, index in (("train/loss", "loss", None), ("train/grad_norm", "grad_norm", None),
                            ("train/lr", "lr", None), ("speed/tokens_per_s", "tokens_per_s", None),
                            ("speed/mfu", "mfu", None), ("memory/peak_gib", "peak_memory_gib", None),
                            ("step_time_per_rank/rank_1", "step_time_s_per_rank", 1)):
        points = events.Scalars(tag)
        assert [p.step for p in points] == [1, 2, 3]
        for point, record in zip(points, records):
            value = record[key] if index is None else record[key][index]
            assert point.value == pytest.approx(value, rel=1e-6)  # stored as float32


def test_resume_past_a_corrupted_newest_checkpoint_saves_that_step_again(tmp_path, capsys):
    """Also the newcomer's `train --nproc 1` with no --cluster."""
    root = tmp_path / "ck"
    run = ["train", "--nproc", "1", *SMALL, "--checkpoint-dir", str(root), "--checkpoint-every", "1", "--keep", "5"]
    assert main([*run, "--steps", "2"]) == 0
    assert "done: 2 steps of dp1 tp1 pp1" in capsys.readouterr().out
    shard = next((root / "step-00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated: the manifest no longer matches
    assert main([*run, "--steps", "3", "--resume"]) == 0  # runs step 2 again: it must save there
    err = capsys.readouterr().err
    assert f"warning: checkpoint {root / 'step-00000002'} is corrupted" in err
    assert "moved it aside to step-00000002.corrupt (kept, not deleted); resuming from step-00000001" in err
    assert (root / "step-00000002.corrupt" / shard.name).exists()  # kept, with its damaged file
    for step in (1, 2, 3):
        assert checkpoint_problem(root / f"step-{step:08d}") is None
