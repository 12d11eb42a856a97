"""Predicted versus measured: what a run's plan promised (cost model and simulator) and what it did.

Measured figures are medians over the steps after the warm-up (report/load.py). Errors are signed:
error % = 100 (predicted - measured) / measured, so +50% means the model predicted 1.5x what was
measured; error seconds likewise (predicted - measured). The per-rank step time is each rank's own
step, from its start until its optimizer step is done; its prediction is the step time (every rank's
optimizer ends together in the model).

Largest sources of error: with a trace, each pipeline rank's step is cut into the same parts in the
simulation and in the measurement (report/measured.py: each stage's F/B/I/W actions, the optimizer,
and the rest: bubble, exposed communication, host work), and the parts whose predicted seconds per step
are furthest from the measured ones are named. Without a trace only the whole step can be compared.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from fivefold.report.load import Run
from fivefold.report.measured import (OTHER, busiest_row, count_of, measured_events, measured_parts, part_name,
                                      pipeline_rows, simulated_parts, split_by_step, typical_step)
from fivefold.sim.engine import OPTIMIZER
from fivefold.spec.units import GIB

SOURCES_SHOWN = 3


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


@dataclass
class Figure:
    """One predicted-versus-measured line."""

    key: str  # its name in --json
    name: str
    unit: str  # "s", "tokens/s", "%", "GiB"
    predicted: float | None  # the cost model's estimate
    simulated: float | None  # the simulator's replay of the plan with the same estimate
    measured: float | None

    def to_dict(self) -> dict:
        return {"name": self.name, "unit": self.unit, "predicted": self.predicted, "simulated": self.simulated,
                "measured": self.measured, "error_pct": error_pct(self.predicted, self.measured),
                "simulated_error_pct": error_pct(self.simulated, self.measured)}


@dataclass
class Source:
    """One part of one pipeline rank's step, predicted (simulated) and measured, seconds per step."""

    what: str
    pp_rank: int
    rank: int
    count: int  # actions in the part (micro-batches), 1 for the optimizer and the rest
    predicted_s: float
    measured_s: float

    @property
    def error_s(self) -> float:
        return self.predicted_s - self.measured_s

    def to_dict(self) -> dict:
        return {"what": self.what, "pp_rank": self.pp_rank, "rank": self.rank, "count": self.count,
                "predicted_s": self.predicted_s, "measured_s": self.measured_s, "error_s": self.error_s,
                "error_pct": error_pct(self.predicted_s, self.measured_s)}


@dataclass
class Report:
    """Everything `fivefold report` prints (and --json writes)."""

    run: str
    plan: str  # Plan.describe()
    stack: str  # the software stack the cost model assumed
    warmup_steps: int
    measured_steps: list[int]
    figures: list[Figure]  # step time, tokens/s, MFU
    ranks: list[dict]  # per global rank: coords, memory and own step time figures
    breakdown: list[dict]  # where the step goes: compute / optimizer / other, predicted, simulated, measured
    sources: list[Source]  # every part, largest |error| first
    traced_steps: list[int] = field(default_factory=list)
    timeline_step: int | None = None  # the traced step drawn in the picture
    timeline: str | None = None  # path of the picture, once written
    notes: list[str] = field(default_factory=list)
    moe: dict | None = None  # MoE runs: auxiliary loss and expert load (tokens per expert, max/mean)

    def to_dict(self) -> dict:
        return {"run": self.run, "plan": self.plan, "stack": self.stack, "warmup_steps": self.warmup_steps,
                "measured_steps": self.measured_steps, "traced_steps": self.traced_steps,
                **{f.key: f.to_dict() for f in self.figures},
                "ranks": self.ranks, "breakdown": self.breakdown,
                "largest_sources_of_error": [s.to_dict() for s in self.sources[:SOURCES_SHOWN]],
                "sources": [s.to_dict() for s in self.sources], "timeline_step": self.timeline_step,
                "timeline": self.timeline, "notes": self.notes, "moe": self.moe}


def default_stack() -> str:
    """fivefold's own runtime stack when the cost model has it, else `modern`."""
    from fivefold.cost.stack import STACKS

    return "fivefold" if "fivefold" in STACKS else "modern"


def _median(records: list[dict], name: str, index: int | None = None) -> float | None:
    values = [r[name] if index is None else r[name][index] for r in records if name in r]
    return statistics.median(values) if values else None


def moe_summary(records: list[dict], events: list[dict] | None = None) -> dict | None:
    """Auxiliary loss and expert load of the measured steps (the metrics an MoE run writes), how its experts ran,
    and the expert collapses its events report (runtime/expert_parallel.py CollapseWatch), or None."""
    if not any("expert_load_max_over_mean" in r for r in records):
        return None
    loads = [r["expert_load_max_over_mean"] for r in records if "expert_load_max_over_mean" in r]
    collapses = [{k: e[k] for k in ("layer", "expert", "since_step", "steps")}
                 for e in events or [] if e.get("kind") == "expert_collapse"]
    return {"aux_loss_median": _median(records, "aux_loss"), "aux_loss_last": records[-1].get("aux_loss"),
            "expert_load_max_over_mean_median": statistics.median(loads),
            "expert_load_max_over_mean_worst": max(loads),
            "expert_rank_imbalance_median": _median(records, "expert_rank_imbalance"),
            "expert_gemm": records[-1].get("expert_gemm"), "collapses": collapses}


def with_run_precision(stack: Any, records: list[dict]) -> Any:
    """The stack as the run ran: compiled blocks (--compile), its FP8 recipe and how its MoE experts ran (the
    metrics records say "compile", "fp8_recipe" and "expert_gemm")."""
    from fivefold.cost.fp8 import with_fp8_recipe
    from fivefold.cost.stack import with_compile, with_expert_gemm

    last = records[-1] if records else {}
    stack = with_compile(stack, any(r.get("compile") for r in records))
    return with_expert_gemm(with_fp8_recipe(stack, last.get("fp8_recipe")), last.get("expert_gemm"))


def build_report(run: Run, stack_name: str | None = None) -> tuple[Report, Any, Any]:
    """(Report, Estimate, SimResult) of a run; the picture is written separately (report/timeline.py)."""
    from fivefold.cost import estimate, stack_named
    from fivefold.elastic.events import read_events
    from fivefold.sim import simulate_plan

    plan, notes = run.plan, []
    # Under ep the step waits for the busiest rank's experts: a property of the router's choices, not of the
    # machine, so the prediction takes the imbalance the run measured (the plan's is a guess made before).
    routed = _median(run.measured, "expert_rank_imbalance")
    if routed is not None and abs(routed - plan.train.expert_imbalance) > 0.005:
        notes.append(f"predicted with the expert imbalance this run measured ({routed:.3g}, the busiest ep rank's "
                     f"tokens over the mean); the plan said {plan.train.expert_imbalance:.3g}")
        plan = replace(plan, train=replace(plan.train, expert_imbalance=max(1.0, routed)))
    # The experts' GEMMs take the shapes the router gave them: the busiest expert's tokens over the mean, as measured.
    load = _median(run.measured, "expert_load_max_over_mean")
    if load is not None and abs(load - plan.train.expert_load) > 0.005:
        notes.append(f"predicted with the expert load this run measured (the busiest expert {load:.3g}x the mean over "
                     f"experts, worst MoE layer, median of the measured steps); the plan said "
                     f"{plan.train.expert_load:.3g}")
        plan = replace(plan, train=replace(plan.train, expert_load=max(1.0, load)))
    stack = with_run_precision(stack_named(stack_name or default_stack()), run.measured)
    predicted = estimate(plan, stack)
    simulated = simulate_plan(plan, estimate=predicted)
    measured = run.measured
    sim_tokens = plan.train.tokens_per_step / simulated.step_time_s
    sim_mfu = predicted.mfu * predicted.step_time_s / simulated.step_time_s
    figures = [
        Figure("step_time_s", "step time", "s", predicted.step_time_s, simulated.step_time_s,
               _median(measured, "step_time_s")),
        Figure("tokens_per_s", "tokens/s", "tokens/s", predicted.tokens_per_s, sim_tokens,
               _median(measured, "tokens_per_s")),
        Figure("mfu_pct", "MFU", "%", 100 * predicted.mfu, 100 * sim_mfu, 100 * _median(measured, "mfu")),
    ]
    # Per-rank lists come every --metrics-every steps (and on the first and last): medians over those.
    per_rank = any("peak_memory_gib_per_rank" in r for r in measured)
    if not per_rank:
        notes.append("the metrics file has no per-rank lists (a run of an older fivefold): memory is the "
                     "busiest rank's, step time rank 0's")
    if all(group.device.name == "cpu" for group in plan.cluster.groups):
        notes.append("on CPU the measured memory is each process's peak resident set (Python, torch, the model), "
                     "the predicted one device memory with the stack's reserved bytes: compare them loosely")
    ranks = []
    for rank in range(plan.world_size):
        coords = plan.coords(rank)
        pp_rank = coords["pp"]
        memory = Figure("peak_memory_gib", "peak memory", "GiB", predicted.rank_memory[pp_rank].total / GIB,
                        simulated.ranks[pp_rank].peak_memory_bytes / GIB,
                        _median(measured, "peak_memory_gib_per_rank", rank) if per_rank
                        else _median(measured, "peak_memory_gib"))
        own_time = Figure("step_time_s", "step time", "s", predicted.step_time_s, simulated.step_time_s,
                          _median(measured, "step_time_s_per_rank", rank) if per_rank
                          else _median(measured, "step_time_s"))
        ranks.append({"rank": rank, "coords": coords, "memory_gib": memory.to_dict(),
                      "step_time_s": own_time.to_dict()})

    report = Report(run=str(run.folder), plan=plan.describe(), stack=stack.name, warmup_steps=run.warmup_steps,
                    measured_steps=[r["step"] for r in measured], figures=figures, ranks=ranks, breakdown=[],
                    sources=[], notes=notes, moe=moe_summary(run.measured, read_events(run.folder)))
    sim_parts = simulated_parts(simulated)
    steps = split_by_step(run.trace, run.warmup_steps) if run.trace else []
    if steps:
        report.traced_steps = [s.step for s in steps]
        report.timeline_step = typical_step(steps).step
        if any(s.step <= run.warmup_steps for s in steps):
            notes.append(f"every traced step is a warm-up step (1..{run.warmup_steps}); trace a longer run")
        got_parts = measured_parts(plan, steps)
        report.sources = _sources(plan, simulated, sim_parts, got_parts,
                                  measured_events(plan, typical_step(steps)))
        report.breakdown = _breakdown(predicted, sim_parts, got_parts)
    else:
        step_time = figures[0]
        report.sources = [Source("whole step (run `fivefold train --trace` to split it)", 0, 0, 1,
                                 predicted.step_time_s, step_time.measured or 0.0)]
        report.breakdown = _breakdown(predicted, sim_parts, None)
        notes.append("no trace in the run folder: the largest sources of error need `fivefold train --trace`")
    return report, predicted, simulated


def _sources(plan, simulated, sim_parts: list[dict], got_parts: list[dict], got_events: list) -> list[Source]:
    rows = pipeline_rows(plan)
    sources = []
    for row, rank in enumerate(rows):
        for key in dict.fromkeys([*sim_parts[row], *got_parts[row]]):
            count = max(count_of(simulated.events, row, key), count_of(got_events, row, key))
            sources.append(Source(part_name(key), row, rank, count, sim_parts[row].get(key, 0.0),
                                  got_parts[row].get(key, 0.0)))
    return sorted(sources, key=lambda s: -abs(s.error_s))


def _breakdown(predicted, sim_parts: list[dict], got_parts: list[dict] | None) -> list[dict]:
    """Compute / optimizer / other seconds of the busiest pipeline rank: estimate, simulation, measurement."""
    b = predicted.breakdown_s
    estimate_parts = {
        "compute": sum(b.get(k, 0.0) for k in ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm",
                                                "host_overhead")),
        "optimizer": b.get("optimizer", 0.0),
        "other": sum(b.get(k, 0.0) for k in ("bubble", "pp_comm", "dp_comm"))}

    def grouped(parts: list[dict] | None) -> dict | None:
        if parts is None:
            return None
        row = parts[busiest_row(parts)]
        return {"compute": sum(v for k, v in row.items() if isinstance(k, tuple)),
                "optimizer": row.get(OPTIMIZER, 0.0), "other": row.get(OTHER, 0.0)}

    simulated, measured = grouped(sim_parts), grouped(got_parts)
    names = {"compute": "compute (F/B/I/W, with tp/cp/ep communication)", "optimizer": "optimizer",
             "other": "other: bubble, exposed communication, host work"}
    return [{"part": part, "name": names[part], "predicted_s": estimate_parts[part],
             "simulated_s": simulated[part] if simulated else None,
             "measured_s": measured[part] if measured else None} for part in names]


def report_run(path: str, stack_name: str | None = None) -> Report:
    """Load a run, compare it, and when it was traced write RUN/report-timeline.png."""
    from fivefold.report.load import load_run
    from fivefold.report.timeline import PICTURE, write_comparison_png

    run = load_run(path)
    report, _, simulated = build_report(run, stack_name)
    if report.timeline_step is not None:
        steps = split_by_step(run.trace, run.warmup_steps)
        step = next(s for s in steps if s.step == report.timeline_step)
        labels = [f"pp{row}: rank {rank}" for row, rank in enumerate(pipeline_rows(run.plan))]
        picture = write_comparison_png(
            simulated, measured_events(run.plan, step), step.length, labels, run.folder / PICTURE,
            (f"simulated ({report.plan}, stack {report.stack})", f"measured (step {step.step}, traced)"))
        report.timeline = str(picture)
    else:  # a picture of an earlier, traced run in this folder would not show this one
        (run.folder / PICTURE).unlink(missing_ok=True)
    return report
