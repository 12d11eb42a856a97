"""Read a run folder: its plan, its metrics file and, when the run was traced, its trace.

A run folder is what `fivefold train --metrics-file RUN/metrics.jsonl [--trace]` leaves behind:
RUN/plan.toml, RUN/metrics.jsonl (one JSON object per step, rank 0's view plus per-rank lists) and, with
--trace, RUN/trace.jsonl (one JSON object per timed span of every rank, runtime/trace.py).

The metrics file is appended to, so a folder reused by several runs (or a resumed run) holds several
histories; the last one counts (see _last_history). The first WARMUP_STEPS steps
of it are left out of every measured figure: step 1 builds lazily (pipelining shape inference, allocator
growth, NCCL communicators, cuBLAS heuristics) and step 2 can still grow caches. A run of at most
WARMUP_STEPS steps keeps its last step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import SpecError
from fivefold.spec import Plan, load_plan
from fivefold.spec.jsonfields import Fields

WARMUP_STEPS = 2
METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.toml"
TRACE_FILE = "trace.jsonl"  # the name runtime/trace.py writes
REQUIRED_FIELDS = ("step", "step_time_s", "tokens_per_s", "mfu", "peak_memory_gib")
# Numbers a record may hold beyond REQUIRED_FIELDS (loss and grad_norm are NaN on a bad step).
LOGGED_NUMBERS = ("loss", "grad_norm", "lr", "tokens", "wall_time", "aux_loss", "expert_rank_imbalance",
                  "expert_rank_imbalance_median", "expert_load_max_over_mean", "eval_loss", "eval_perplexity")
SPAN_FIELDS = ("rank", "step", "kind", "stage", "micro_batch", "start", "end")
PROFILE_DIR = "profile"  # --profile-steps: RUN/profile/rank<R>.trace.json (runtime/profiling.py)
WANDB_ID_FILE = "wandb-run-id"  # --wandb: the run's W&B id, kept across resumes (runtime/tracking.py)
# What a run leaves in its folder besides the metrics file, removed by `train --overwrite` (the plan and job
# files are rewritten by every launch; TensorBoard and W&B files live where they were asked to).
RUN_OUTPUTS = (TRACE_FILE, "events.jsonl", "recovery.json", "pids", PROFILE_DIR, WANDB_ID_FILE,
               "report-timeline.png", "report-curves.png", "report-compare.png")


@dataclass
class Run:
    """One run's files, read and checked."""

    folder: Path
    plan: Plan
    records: list[dict]  # the last history of the metrics file, every step
    measured: list[dict]  # records after the warm-up steps
    warmup_steps: int  # how many were left out
    trace: list[dict]  # spans of trace.jsonl, [] when the run was not traced
    metrics_path: Path
    trace_path: Path | None


def read_jsonl(path: Path, what: str) -> list[dict]:
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise SpecError(str(path), f"byte {exc.start}", f"is not text; a {what} holds one JSON object per line "
                                                        "(is this the file `fivefold train` wrote?)") from None
    except OSError as exc:
        raise SpecError(str(path), "unreadable", exc.strerror or str(exc)) from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # a run killed while writing its last line
                break
            raise SpecError(f"{path}:{number}", line[:40], f"is not JSON; a {what} holds one JSON object per line")
        if not isinstance(row, dict):
            raise SpecError(f"{path}:{number}", line[:40], f"is not a JSON object; a {what} holds one per line")
        rows.append(row)
    return rows


def recorded_steps(path: Path) -> list[int]:
    """The step numbers a metrics file holds, in file order ([] for a missing or empty file)."""
    if not path.is_file():
        return []
    return [row["step"] for row in read_jsonl(path, "metrics file") if isinstance(row.get("step"), int)]


def check_record(record: dict, where: str) -> None:
    """One metrics record holds what `fivefold train` writes, with its types (spec/jsonfields.py)."""
    fields = Fields(record, where)
    fields.count("step", minimum=0)
    for name in ("step_time_s", "tokens_per_s", "mfu", "peak_memory_gib"):
        fields.real(name, minimum=0)
    if "first_step" in record:
        fields.count("first_step", minimum=0)
    for name in record:
        if name.endswith("_per_rank"):
            fields.reals(name)
        elif name in LOGGED_NUMBERS and not (isinstance(record[name], (int, float))
                                             and not isinstance(record[name], bool)):
            raise fields.fail(name, record[name], "must be a number (NaN marks a bad step)")


def check_span(span: dict, where: str) -> None:
    """One trace span as runtime/trace.py writes it."""
    fields = Fields(span, where)
    fields.count("rank", minimum=0)
    fields.count("step", minimum=0)
    fields.text("kind")
    fields.count("stage", minimum=-1)
    fields.count("micro_batch", minimum=-1)
    fields.real("end", minimum=fields.real("start"))


def _last_history(records: list[dict]) -> list[dict]:
    """The records of the last launch: it starts where the step number stops increasing, or at the step
    the runtime names as its launch's first (`first_step`, after a resume)."""
    start = 0
    for index in range(1, len(records)):
        if (records[index]["step"] <= records[index - 1]["step"]
                or records[index].get("first_step") == records[index]["step"]):
            start = index
    return records[start:]


def find_files(path: str | Path) -> tuple[Path, Path]:
    """(metrics file, plan file) of a run folder or of a metrics file."""
    path = Path(path)
    if not path.exists():
        raise SpecError("run", str(path), "no such folder or file; give a run folder (plan.toml + metrics.jsonl, "
                                          "from `fivefold train --metrics-file RUN/metrics.jsonl`) or its metrics file")
    if path.is_dir():
        metrics = path / METRICS_FILE
        if not metrics.exists():
            others = [p for p in path.glob("*.jsonl") if p.name != TRACE_FILE]
            if len(others) != 1:
                raise SpecError("run", str(path), f"holds no {METRICS_FILE}; give the metrics file itself, or the "
                                                  "folder `fivefold train --metrics-file` wrote")
            metrics = others[0]
    else:
        metrics = path
    plan = metrics.parent / PLAN_FILE
    if not plan.exists():
        raise SpecError("plan", str(plan), "is missing: the report needs the run's plan next to its metrics "
                                           "(`fivefold train --metrics-file` writes it there); copy the plan there")
    return metrics, plan


def load_run(path: str | Path) -> Run:
    """Read and check a run folder (or a metrics file with plan.toml beside it)."""
    metrics_path, plan_path = find_files(path)
    plan = load_plan(plan_path)
    records = read_jsonl(metrics_path, "metrics file")
    if not records:
        raise SpecError("run", str(metrics_path), "holds no steps; let `fivefold train` run at least one step")
    for number, record in enumerate(records, 1):
        missing = [name for name in REQUIRED_FIELDS if name not in record]
        if missing:
            raise SpecError(f"{metrics_path}:{number}", ",".join(missing),
                            "missing; the report reads what `fivefold train --metrics-file` writes")
        check_record(record, f"{metrics_path}:{number}")
    records = _last_history(records)
    for name in ("peak_memory_gib_per_rank", "step_time_s_per_rank"):
        for record in records:
            if name in record and (not isinstance(record[name], list) or len(record[name]) != plan.world_size):
                raise SpecError(f"{metrics_path}: step {record['step']} {name}",
                                len(record[name]) if isinstance(record[name], list) else record[name],
                                f"needs one value per rank of the plan ({plan.world_size}): is plan.toml this run's?")
    warmup = min(WARMUP_STEPS, len(records) - 1)
    trace_path = metrics_path.parent / TRACE_FILE
    trace: list[dict] = []
    if trace_path.exists():
        trace = read_jsonl(trace_path, "trace file")
        for number, span in enumerate(trace, 1):
            missing = [name for name in SPAN_FIELDS if name not in span]
            if missing:
                raise SpecError(f"{trace_path}:{number}", ",".join(missing),
                                "missing; the report reads what `fivefold train --trace` writes")
            check_span(span, f"{trace_path}:{number}")
        ranks = {span.get("rank") for span in trace}
        if not ranks <= set(range(plan.world_size)):
            raise SpecError(str(trace_path), sorted(ranks - set(range(plan.world_size)), key=str)[:3],
                            f"names ranks the plan does not have (0..{plan.world_size - 1}): is plan.toml this run's?")
    return Run(folder=metrics_path.parent, plan=plan, records=records, measured=records[warmup:], warmup_steps=warmup,
               trace=trace, metrics_path=metrics_path, trace_path=trace_path if trace else None)
