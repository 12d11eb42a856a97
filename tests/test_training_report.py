"""`fivefold report RUN` for training, on run folders written here (no training): the curves' history across
resumes, the steps a metrics file holds twice (after a resume, or a second run appended: a warning), each
launch with its Slurm requeue, SIGTERM, restarts and skipped updates from events.jsonl, the profiler files,
the curves picture and `--compare` overlaying runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.report.training import history_of, load_training_run, repeated_steps, summarize_training
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster


def record(step: int, loss: float, wall: float, first_step: int = 1, **extra) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 1.0 + 0.1 * step, "lr": 1e-3 * min(step, 4) / 4,
            "tokens": 256 * step, "step_time_s": 0.5, "tokens_per_s": 512.0 + step, "mfu": 0.01,
            "peak_memory_gib": 0.3, "first_step": first_step, "skipped": False, "wall_time": wall, **extra}


def write_run(folder: Path, records: list[dict], events: list[dict] = ()) -> Path:
    folder.mkdir(parents=True)
    Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x1xcpu"),
         train=TrainSpec(seq_len=32, global_batch=8, dtype="fp32")).save(folder / "plan.toml")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def requeued_run(folder: Path) -> Path:
    """Launch 1 (Slurm job 77) ran steps 1-5, saved step 4 on its way, was stopped by SIGTERM after step 5 without
    a new save; launch 2 (the requeue) resumed at step 4, evaluated at step 6, skipped the update of step 7."""
    records = [record(s, 6.0 - 0.3 * s, 100 + s) for s in range(1, 6)]
    records += [record(5, 4.45, 201, first_step=5), record(6, 4.2, 202, first_step=5, eval_loss=4.3),
                record(7, math.nan, 203, first_step=5, skipped=True), record(8, 4.0, 204, first_step=5, eval_loss=4.1)]
    events = [{"kind": "launch", "time": 100.0, "restart": -1, "slurm_job_id": "77", "slurm_restart_count": 0},
              {"kind": "start", "time": 100.1, "restart": 0, "started": 100.1},
              {"kind": "ready", "time": 100.5, "restart": 0, "step": 0, "path": None},
              {"kind": "term", "time": 105.5, "restart": 0, "step": 5, "saved": False, "finished_save": None,
               "newest_step": 4, "unsaved_seconds": 0.5, "threshold": 60.0},
              {"kind": "end", "time": 106.0, "restart": -1, "outcome": "interrupted"},
              {"kind": "launch", "time": 200.0, "restart": -1, "slurm_job_id": "77", "slurm_restart_count": 1},
              {"kind": "start", "time": 200.1, "restart": 0, "started": 200.1},
              {"kind": "resumed", "time": 200.6, "restart": 0, "step": 4, "path": "ck/step-00000004"},
              {"kind": "bad_step", "time": 203.0, "restart": 0, "step": 7, "position": 48, "reason": "loss is nan"},
              {"kind": "end", "time": 205.0, "restart": -1, "outcome": "finished"}]
    return write_run(folder, records, events)


def test_the_history_is_the_run_the_file_ends_with_and_repeats_are_named():
    steps = [1, 2, 3, 4, 5, 5, 6, 7]
    records = [{"step": s, "first_step": 5 if i >= 5 else 1} for i, s in enumerate(steps)]
    assert [r["step"] for r in history_of(records)] == [1, 2, 3, 4, 5, 6, 7]
    assert history_of(records)[4] is records[5]  # step 5's last run
    assert repeated_steps(records) == [{"first": 5, "last": 5, "line": 6, "kind": "resumed"}]
    twice = [{"step": s, "first_step": 1} for s in (1, 2, 3, 4, 1, 2, 3, 4)]  # a re-run appended to the file
    assert repeated_steps(twice) == [{"first": 1, "last": 4, "line": 5, "kind": "rerun"}]
    assert [r["step"] for r in history_of(twice)] == [1, 2, 3, 4] and history_of(twice)[0] is twice[4]


def test_report_of_a_requeued_run_shows_its_curves_and_launches(tmp_path, capsys):
    run = requeued_run(tmp_path / "run")
    (run / "profile").mkdir()
    (run / "profile" / "rank0-steps2-3.trace.json").write_text('{"traceEvents": []}')
    assert main(["report", str(run), "--json"]) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert training["steps"] == [1, 8]
    assert training["loss"] == {"first": 5.7, "last": 4.0, "min": 4.0, "min_step": 8}
    assert training["eval_loss"] == {"evaluations": 2, "last": 4.1, "last_step": 8, "min": 4.1}
    assert training["lr"] == {"first": 0.25e-3, "max": 1e-3, "last": 1e-3}
    assert training["skipped_updates"] == 1
    first, second = training["launches"]
    assert (first["slurm_job_id"], first["slurm_restart_count"], first["steps"], first["outcome"]) == \
        ("77", 0, [1, 5], "interrupted")
    assert first["terminated"] == {"step": 5, "saved": False, "finished_save": None, "newest_step": 4,
                                   "unsaved_seconds": 0.5}
    assert (second["slurm_restart_count"], second["resumed_at_step"], second["steps"]) == (1, 4, [5, 8])
    assert second["skipped_steps"] == [{"step": 7, "position": 48, "reason": "loss is nan"}]
    assert training["warnings"] == [f"{run / 'metrics.jsonl'} holds step 5 twice: from line 6 the run went on from "
                                    "its checkpoint of step 4 (a resume, restart or rollback), so these steps ran "
                                    "again; the curves show their last run"]
    assert training["profiles"] == [str(run / "profile" / "rank0-steps2-3.trace.json")]
    assert Path(training["curves"]).stat().st_size > 20_000
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert ("launch 1 (Slurm job 77, requeued 0 time(s)); steps 1-5; SIGTERM after step 5: newest checkpoint step 4; "
            "interrupted") in out
    assert ("launch 2 (Slurm job 77, requeued 1 time(s)); resumed at step 4; steps 5-8; skipped the update of step 7 "
            "(loss is nan); finished") in out
    assert "warning: " in out and "ui.perfetto.dev" in out


def test_a_second_run_appended_to_a_metrics_file_is_a_warning(tmp_path):
    records = [record(s, 5.0 - 0.1 * s, 100 + s) for s in range(1, 5)]
    records += [record(s, 5.5 - 0.1 * s, 200 + s) for s in range(1, 5)]
    run = load_training_run(write_run(tmp_path / "run", records))
    summary = summarize_training(run)
    assert summary.warnings == [f"{run.metrics_path} holds steps 1-4 twice: from line 5 a second run starting at "
                                "step 1 was appended to it (the curves show the last one); give each run its own "
                                "--metrics-file"]
    assert summary.figures["loss"]["first"] == pytest.approx(5.4)  # the last run's


def test_compare_overlays_runs_and_tabulates_them(tmp_path, capsys):
    a = write_run(tmp_path / "a", [record(s, 5.0 - 0.2 * s, 100 + s) for s in range(1, 7)])
    b = write_run(tmp_path / "b", [record(s, 5.0 - 0.1 * s, 100 + s) for s in range(1, 5)])
    assert main(["report", str(a), "--compare", str(b), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["training"]["compare"] == str(a / "report-compare.png")
    assert Path(report["training"]["compare"]).stat().st_size > 20_000
    assert [(c["run"], c["steps"], c["loss"]["last"]) for c in report["compared"]] == [(str(b), [1, 4], 4.6)]
    assert main(["report", str(a), "--compare", str(b)]) == 0
    table = capsys.readouterr().out.split("runs compared")[1].splitlines()
    assert table[2].split()[:4] == [str(a), "1-6", "4.8", "3.8"] and table[3].split()[:4] == [str(b), "1-4", "4.9",
                                                                                              "4.6"]
    assert main(["report", str(a), "--compare", str(tmp_path / "nope")]) == 2
    assert "error: run=" in capsys.readouterr().err
