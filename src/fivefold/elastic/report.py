"""The recovery report of a run, from RUN/events.jsonl and the metrics file (no torch import).

For each failure the agent detected (incarnation i failed, incarnation i+1 took over):
    detection   the failure (the first error any rank of incarnation i wrote; survivors of a killed peer
                see its sockets close at once) -> the agent noticed. With no error at all, from the end
                of the last completed step: an upper bound.
    restart     the agent noticed -> the new incarnation's rank 0 started training (stop, rendezvous,
                new processes, imports).
    reload      that start -> the checkpoint was loaded (process group, model build, DCP load).
    recomputed  the steps done after the reloaded checkpoint, which are done again, plus the part of
                the step that was running when the failure came.
The loss guard's rollbacks count the same way (reload and recomputed steps; nothing to detect or restart).
Effective training-time ratio = productive step time / wall time, where productive step time sums
the step times of the steps that count: the last run of each step, updates the guard skipped excluded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from fivefold.elastic.events import LAUNCHER, read_events

REPORT_FILE = "recovery.json"
SECONDARY = ("Connection closed by peer", "Connection reset", "Broken pipe")  # a peer's failure, seen from here


def read_metrics(path: str | Path | None) -> list[dict]:
    if not path or not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _first(events: list[dict], kind: str, restart: int) -> dict | None:
    return next((e for e in events if e["kind"] == kind and e["restart"] == restart), None)


def _failure(events: list[dict], records: list[dict], index: int, detected: dict) -> dict:
    """The failure of incarnation `index`, detected by the agent at `detected`."""
    errors = [e for e in events if e["kind"] == "error" and e["restart"] == index]
    primary = [e for e in errors if not any(text in e["message"] for text in SECONDARY)]
    done = [r for r in records if r["wall_time"] <= detected["time"] and
            (not (start := _first(events, "start", index)) or r["wall_time"] >= start["time"])]
    last_end = done[-1]["wall_time"] if done else (_first(events, "start", index) or detected)["time"]
    if primary:
        first = min(primary, key=lambda e: e["time"])
        kind, rank, message = first.get("error", "error"), first["rank"], first["message"]
    elif silent := [r for r in detected.get("dead_ranks", []) if r not in {e["rank"] for e in errors}]:
        kind, rank = "killed", silent[0]  # dead without a word; the others died of its closed sockets
        message = "the process ended without an error (a signal such as SIGKILL, or the OOM killer)"
    else:
        kind, rank, message = "unknown", None, "no rank reported an error"
    failed_at = min((e["time"] for e in errors), default=last_end)
    after = _first(events, "start", index + 1)
    resumed = next((e for e in events if e["kind"] in ("resumed", "ready") and e["restart"] == index + 1), None)
    reload_step = resumed["step"] if resumed else 0
    redone = [r for r in done if r["step"] > reload_step]
    return {"kind": kind, "rank": rank, "message": message,
            "step": (done[-1]["step"] + 1) if done else None, "resumed_at_step": reload_step,
            "seconds": {"detection": max(0.0, detected["time"] - failed_at),
                        "restart": max(0.0, after["time"] - detected["time"]) if after else None,
                        "reload": max(0.0, resumed["time"] - after["started"]) if after and resumed else None,
                        "recomputed_steps": sum(r["step_time_s"] for r in redone) + max(0.0, failed_at - last_end)},
            "recomputed_step_count": len(redone)}


def _rollback(event: dict, records: list[dict]) -> dict:
    """A loss-guard rollback: the steps after the checkpoint it went back to are run again."""
    redone: dict[int, dict] = {}
    if event["to_step"] is not None:
        for record in records:  # the last run of each rolled-back step before the rollback
            if event["to_step"] < record["step"] <= event["step"] and record["wall_time"] <= event["time"]:
                redone[record["step"]] = record
    return {"kind": "loss guard rollback", "step": event["step"], "to_step": event["to_step"],
            "skipped_positions": event["positions"],
            "seconds": {"reload": event["reload_s"], "recomputed_steps": sum(r["step_time_s"] for r in redone.values())}}


def split_launches(events: list[dict]) -> list[list[dict]]:
    """The events of each launch of a run, oldest first: each begins with a `launch` event (a resume or a requeue
    appends a launch to the run's events.jsonl); events before the first one form a launch of their own."""
    launches: list[list[dict]] = []
    for event in events:
        if event["kind"] == "launch" or not launches:
            launches.append([])
        launches[-1].append(event)
    return launches


def launch_records(records: list[dict], launch: list[dict], following: list[dict] | None) -> list[dict]:
    """The metrics records written during `launch` (before the `following` launch began)."""
    start = launch[0]["time"] if launch and launch[0]["kind"] == "launch" else -math.inf
    end = following[0]["time"] if following else math.inf
    return [r for r in records if start <= r["wall_time"] < end]


def build_report(run_dir: str | Path, metrics_file: str | Path | None) -> dict:
    """The recovery report of the run's last launch."""
    launches = split_launches(read_events(run_dir)) or [[]]
    records = launch_records([r for r in read_metrics(metrics_file) if "wall_time" in r], launches[-1], None)
    return launch_report(launches[-1], records)


def launch_report(events: list[dict], records: list[dict]) -> dict:
    """Failures, rollbacks, skipped updates, stragglers and time lost of one launch's events and records."""
    launched = next((e for e in events if e["kind"] == "launch"), None)
    ended = next((e for e in reversed(events) if e["kind"] == "end"), None)
    detections = [e for e in events if e["kind"] == "detected" and e["restart"] == LAUNCHER]
    failures = [_failure(events, records, index, detected) for index, detected in enumerate(detections)]
    rollbacks = [_rollback(event, records) for event in events if event["kind"] == "rollback"]
    last_run = {}
    for record in records:  # a step run again after a recovery replaces its earlier run
        last_run[record["step"]] = record
    productive = sum(r["step_time_s"] for r in last_run.values() if not r.get("skipped"))
    wall = (ended["time"] - launched["time"]) if launched and ended else None
    bad_steps = [{"step": e["step"], "position": e["position"], "reason": e["reason"]}
                 for e in events if e["kind"] == "bad_step"]
    stragglers = [{k: e[k] for k in ("rank", "host", "since_step", "steps", "ratio", "factor")}
                  for e in events if e["kind"] == "straggler"]
    lost = {part: sum((f["seconds"].get(part) or 0.0) for f in failures + rollbacks)
            for part in ("detection", "restart", "reload", "recomputed_steps")}
    term = next((e for e in events if e["kind"] == "term"), None)  # SIGTERM (runtime/preemption.py)
    terminated = {k: term.get(k) for k in ("step", "saved", "finished_save", "newest_step", "unsaved_seconds")} \
        if term else None
    return {"failures": failures, "rollbacks": rollbacks, "skipped_steps": bad_steps, "stragglers": stragglers,
            "seconds_lost": lost, "productive_step_seconds": productive, "wall_seconds": wall,
            "effective_training_time_ratio": productive / wall if wall else None,
            "outcome": ended.get("outcome") if ended else None, "terminated": terminated,
            "slurm_job_id": launched.get("slurm_job_id") if launched else None,
            "slurm_restart_count": launched.get("slurm_restart_count") if launched else None}


def write_report(run_dir: str | Path, metrics_file: str | Path | None) -> dict:
    report = build_report(run_dir, metrics_file)
    text = json.dumps(report, indent=2, default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v))
    (Path(run_dir) / REPORT_FILE).write_text(text + "\n")
    return report


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f} s"


def render_report(report: dict) -> list[str]:
    """The lines printed at the end of a run."""
    ratio = report["effective_training_time_ratio"]
    lines = [f"recovery: {len(report['failures'])} failure(s), {len(report['rollbacks'])} rollback(s), "
             f"{len(report['skipped_steps'])} skipped update(s), {len(report['stragglers'])} straggler(s); "
             f"effective training time {'?' if ratio is None else f'{ratio:.0%}'} "
             f"({_seconds(report['productive_step_seconds'])} of steps in {_seconds(report['wall_seconds'])})"]
    for failure in report["failures"]:
        s = failure["seconds"]
        where = f"rank {failure['rank']}" if failure["rank"] is not None else "rank unknown"
        lines.append(f"  failure: {failure['kind']} on {where} at step {failure['step']} ({failure['message']}); "
                     f"lost: detection {_seconds(s['detection'])}, restart {_seconds(s['restart'])}, reload "
                     f"{_seconds(s['reload'])}, recomputed {failure['recomputed_step_count']} step(s) "
                     f"{_seconds(s['recomputed_steps'])}; resumed at step {failure['resumed_at_step']}")
    for rollback in report["rollbacks"]:
        s = rollback["seconds"]
        lines.append(f"  rollback: after step {rollback['step']} to step {rollback['to_step']}, skipping batches at "
                     f"samples {rollback['skipped_positions']}; lost: reload {_seconds(s['reload'])}, recomputed "
                     f"{_seconds(s['recomputed_steps'])}")
    for bad in report["skipped_steps"]:
        lines.append(f"  skipped update: step {bad['step']} (batch at sample {bad['position']}): {bad['reason']}")
    if report.get("terminated"):
        term = report["terminated"]
        lines.append(f"  SIGTERM: stopped after step {term['step']}; "
                     + (f"saved step {term['step']}" if term["saved"] else
                        f"newest checkpoint step {term['newest_step']}"))
    for straggler in report["stragglers"]:
        lines.append(f"  straggler: rank {straggler['rank']} on host {straggler['host']}, {straggler['ratio']:.1f}x "
                     f"the median for {straggler['steps']} steps from step {straggler['since_step']}")
    return lines
