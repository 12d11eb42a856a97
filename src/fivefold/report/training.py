"""`fivefold report RUN` for what a training run learned and went through, beside what it cost:

    curves     loss and eval_loss, learning rate, gradient norm and tokens/s over the steps (report/curves.py
               draws them, RUN/report-curves.png; `--compare RUN2 ...` overlays runs in RUN/report-compare.png)
    launches   each launch of the run from RUN/events.jsonl: its Slurm job and requeue count, the step it resumed
               at, SIGTERM and the save it made, its restarts, rollbacks and skipped updates (elastic/report.py)
    repeats    a metrics file that holds a step twice: after a resume, a restart or a rollback (the curves keep
               the last run of each step) or because a second run was appended to the file (a warning)
    profiles   the --profile-steps traces and memory snapshots of RUN/profile/

The history the curves show is the run the metrics file ends with: each record that goes back to an earlier step
cuts the history there (the steps after a checkpoint were run again), so a resumed run reads as one line and a
second run appended to the file replaces the first. No torch here.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fivefold.elastic.events import read_events
from fivefold.elastic.report import launch_records, launch_report, split_launches
from fivefold.errors import SpecError
from fivefold.report.load import METRICS_FILE, PROFILE_DIR, TRACE_FILE, check_record, read_jsonl

PERFETTO = "https://ui.perfetto.dev"


@dataclass
class TrainingRun:
    """A run's metrics file, read and checked (the plan is not needed)."""

    folder: Path
    metrics_path: Path
    records: list[dict]  # every record, in file order
    history: list[dict]  # the run the file ends with (module docstring)
    label: str = ""

    def values(self, name: str) -> list[tuple[int, float]]:
        """(step, value) of `name` over the history, finite values only."""
        return [(r["step"], float(r[name])) for r in self.history
                if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])]


def metrics_path_of(path: str | Path) -> Path:
    """The metrics file of a run folder (or the file itself)."""
    path = Path(path)
    if not path.exists():
        raise SpecError("run", str(path), "no such folder or file; give a run folder (from `fivefold train "
                                          "--metrics-file RUN/metrics.jsonl`) or its metrics file")
    if path.is_file():
        return path
    if (path / METRICS_FILE).is_file():
        return path / METRICS_FILE
    others = [p for p in path.glob("*.jsonl") if p.name not in (TRACE_FILE, "events.jsonl")]
    if len(others) != 1:
        raise SpecError("run", str(path), f"holds no {METRICS_FILE}; give the metrics file itself, or the folder "
                                          "`fivefold train --metrics-file` wrote")
    return others[0]


def history_of(records: list[dict]) -> list[dict]:
    """The run the records end with: a record of an earlier (or the same) step replaces the history from it on."""
    history: list[dict] = []
    for record in records:
        while history and history[-1]["step"] >= record["step"]:
            history.pop()
        history.append(record)
    return history


def load_training_run(path: str | Path) -> TrainingRun:
    metrics = metrics_path_of(path)
    records = read_jsonl(metrics, "metrics file")
    if not records:
        raise SpecError("run", str(metrics), "holds no steps; let `fivefold train` run at least one step")
    for number, record in enumerate(records, 1):
        if "step" not in record:
            raise SpecError(f"{metrics}:{number}", "step", "missing; the report reads what `fivefold train "
                                                           "--metrics-file` writes")
        check_record(record, f"{metrics}:{number}")
    folder = metrics.parent
    return TrainingRun(folder, metrics, records, history_of(records), label=folder.name or str(folder))


def repeated_steps(records: list[dict]) -> list[dict]:
    """Each place where the file goes back to a step it already holds: the steps held twice, the line, and
    why: "resumed" (the run went on from its checkpoint of the step before) or "rerun" (a run that starts at
    step 1 again: a second run appended to the file)."""
    repeats = []
    seen: set[int] = set()
    for index, record in enumerate(records):
        step = record["step"]
        if index and step <= records[index - 1]["step"]:
            segment = [step]
            for later in records[index + 1:]:
                if later["step"] <= segment[-1]:
                    break
                segment.append(later["step"])
            twice = [s for s in segment if s in seen]
            if twice:
                fresh = step == 1 and record.get("first_step", 1) == 1
                repeats.append({"first": twice[0], "last": twice[-1], "line": index + 1,
                                "kind": "rerun" if fresh else "resumed"})
        seen.add(step)
    return repeats


def repeat_lines(path: Path, repeats: list[dict]) -> list[str]:
    """The warnings about steps a metrics file holds twice."""
    lines = []
    for repeat in repeats:
        steps = (f"step {repeat['first']}" if repeat["first"] == repeat["last"]
                 else f"steps {repeat['first']}-{repeat['last']}")
        if repeat["kind"] == "rerun":
            lines.append(f"{path} holds {steps} twice: from line {repeat['line']} a second run starting at step 1 "
                         "was appended to it (the curves show the last one); give each run its own --metrics-file")
        else:
            lines.append(f"{path} holds {steps} twice: from line {repeat['line']} the run went on from its "
                         f"checkpoint of step {repeat['first'] - 1} (a resume, restart or rollback), so these "
                         "steps ran again; the curves show their last run")
    return lines


def launches_of(run: TrainingRun) -> list[dict]:
    """Each launch of the run (RUN/events.jsonl), oldest first, with its steps and what happened in it."""
    launches = split_launches(read_events(run.folder))
    records = [r for r in run.records if "wall_time" in r]
    out = []
    for index, events in enumerate(launches):
        following = launches[index + 1] if index + 1 < len(launches) else None
        mine = launch_records(records, events, following)
        report = launch_report(events, mine)
        started = next((e for e in events if e["kind"] in ("resumed", "ready") and e["restart"] == 0), None)
        out.append({"launch": index + 1, "slurm_job_id": report["slurm_job_id"],
                    "slurm_restart_count": report["slurm_restart_count"],
                    "resumed_at_step": started["step"] if started and started["kind"] == "resumed" else None,
                    "steps": [mine[0]["step"], mine[-1]["step"]] if mine else None,
                    "restarts": len(report["failures"]), "failures": report["failures"],
                    "rollbacks": report["rollbacks"], "skipped_steps": report["skipped_steps"],
                    "terminated": report["terminated"], "outcome": report["outcome"]})
    return out


def profile_files(folder: Path) -> list[str]:
    """The --profile-steps files of a run folder: traces, then CUDA memory snapshots."""
    profile = folder / PROFILE_DIR
    if not profile.is_dir():
        return []
    return [str(p) for p in sorted(profile.glob("*.trace.json")) + sorted(profile.glob("*.memory.pickle"))]


def _median(values: list[tuple[int, float]]) -> float | None:
    return statistics.median(v for _, v in values) if values else None


@dataclass
class TrainingSummary:
    run: str
    steps: list[int]  # first and last step of the history
    figures: dict[str, Any]  # loss, eval_loss, lr, grad_norm, tokens/s
    launches: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    profiles: list[str] = field(default_factory=list)
    curves: str | None = None  # the picture, once written
    compare: str | None = None  # --compare: the picture of the runs overlaid

    def to_dict(self) -> dict:
        return {"run": self.run, "steps": self.steps, **self.figures, "launches": self.launches,
                "warnings": self.warnings, "profiles": self.profiles, "curves": self.curves,
                "compare": self.compare}


def summarize_training(run: TrainingRun) -> TrainingSummary:
    loss, evals = run.values("loss"), run.values("eval_loss")
    lr, norms, speed = run.values("lr"), run.values("grad_norm"), run.values("tokens_per_s")
    lowest = min(loss, key=lambda item: item[1]) if loss else None
    steepest = max(norms, key=lambda item: item[1]) if norms else None
    figures = {
        "loss": {"first": loss[0][1] if loss else None, "last": loss[-1][1] if loss else None,
                 "min": lowest[1] if lowest else None, "min_step": lowest[0] if lowest else None},
        "eval_loss": {"evaluations": len(evals), "last": evals[-1][1] if evals else None,
                      "last_step": evals[-1][0] if evals else None, "min": min((v for _, v in evals), default=None)},
        "lr": {"first": lr[0][1] if lr else None, "max": max((v for _, v in lr), default=None),
               "last": lr[-1][1] if lr else None},
        "grad_norm": {"median": _median(norms), "max": steepest[1] if steepest else None,
                      "max_step": steepest[0] if steepest else None},
        "tokens_per_s": {"median": _median(speed)},
        "skipped_updates": sum(1 for r in run.history if r.get("skipped")),
    }
    return TrainingSummary(str(run.folder), [run.history[0]["step"], run.history[-1]["step"]], figures,
                           launches_of(run), repeat_lines(run.metrics_path, repeated_steps(run.records)),
                           profile_files(run.folder))


def _g(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def training_lines(summary: TrainingSummary) -> list[str]:
    """The terminal summary (rich markup)."""
    f = summary.figures
    loss, evals, lr, norm = f["loss"], f["eval_loss"], f["lr"], f["grad_norm"]
    lines = [f"[bold]training[/bold]: steps {summary.steps[0]}-{summary.steps[1]}; loss {_g(loss['first'])} -> "
             f"{_g(loss['last'])} (lowest {_g(loss['min'])} at step {loss['min_step']})"
             + (f"; eval_loss {_g(evals['last'])} at step {evals['last_step']} ({evals['evaluations']} evaluation(s), "
                f"lowest {_g(evals['min'])})" if evals["evaluations"] else "; no eval_loss (--eval-data)")
             + f"; lr {_g(lr['first'], '.3g')} .. {_g(lr['max'], '.3g')} -> {_g(lr['last'], '.3g')}; grad norm "
               f"median {_g(norm['median'], '.3g')} (highest {_g(norm['max'], '.3g')} at step {norm['max_step']}); "
               f"{_g(f['tokens_per_s']['median'], ',.0f')} tokens/s (median)"]
    for launch in summary.launches:
        lines.append("  " + launch_line(launch))
    if f["skipped_updates"]:
        lines.append(f"  {f['skipped_updates']} update(s) skipped by the loss guard in the curves' steps")
    for warning in summary.warnings:
        lines.append(f"[yellow]warning[/yellow]: {warning}")
    if summary.profiles:
        lines.append(f"profiler: {', '.join(summary.profiles)} (traces open in {PERFETTO}; CUDA memory snapshots in "
                     "https://pytorch.org/memory_viz)")
    if summary.curves:
        lines.append(f"wrote {summary.curves} (loss and eval_loss, lr, grad norm and tokens/s over the steps)")
    if summary.compare:
        lines.append(f"wrote {summary.compare} (the runs overlaid)")
    return lines


def launch_line(launch: dict) -> str:
    """'launch 2 (Slurm job 42, requeued 1 time): resumed at step 5; steps 6-12; ...'."""
    where = ""
    if launch["slurm_job_id"] is not None:
        where = f" (Slurm job {launch['slurm_job_id']}, requeued {launch['slurm_restart_count']} time(s))"
    parts = [f"launch {launch['launch']}{where}"]
    if launch["resumed_at_step"] is not None:
        parts.append(f"resumed at step {launch['resumed_at_step']}")
    parts.append(f"steps {launch['steps'][0]}-{launch['steps'][1]}" if launch["steps"] else "no step")
    for failure in launch["failures"]:
        parts.append(f"restarted after {failure['kind']} on rank {failure['rank']} at step {failure['step']} "
                     f"(resumed at step {failure['resumed_at_step']})")
    for rollback in launch["rollbacks"]:
        parts.append(f"rolled back after step {rollback['step']} to step {rollback['to_step']}")
    for bad in launch["skipped_steps"]:
        parts.append(f"skipped the update of step {bad['step']} ({bad['reason']})")
    term = launch["terminated"]
    if term:
        parts.append(f"SIGTERM after step {term['step']}: " + (f"saved step {term['step']}" if term["saved"] else
                                                              f"newest checkpoint step {term['newest_step']}"))
    if launch["outcome"]:
        parts.append(launch["outcome"])
    return "; ".join(parts)


def compare_lines(summaries: list[TrainingSummary]) -> Any:
    """The --compare table: one row per run."""
    from rich.table import Table

    table = Table(title="runs compared", title_justify="left", box=None, pad_edge=False)
    for column in ("run", "steps", "first loss", "last loss", "lowest", "last eval_loss", "tokens/s"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for s in summaries:
        f = s.figures
        table.add_row(s.run, f"{s.steps[0]}-{s.steps[1]}", _g(f["loss"]["first"]), _g(f["loss"]["last"]),
                      _g(f["loss"]["min"]), _g(f["eval_loss"]["last"]), _g(f["tokens_per_s"]["median"], ",.0f"))
    return table
