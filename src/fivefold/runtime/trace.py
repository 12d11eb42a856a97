"""`fivefold train --trace`: a per-rank timeline of a few steps, for `fivefold report`.

What is timed, on every rank, during the traced steps only:
- with a pipeline: every action torch.distributed.pipelining runs, by wrapping the methods of this
  rank's PipelineStage objects that every schedule calls: forward_one_chunk (F; the last stage's loss,
  computed by the schedule right after it, is added to its F), backward_one_chunk (B, or I when the
  schedule splits the backward), backward_weight_one_chunk (W) and perform_reduce_grad (the FSDP
  gradient reduce-scatter some schedules issue as their own action). Waiting for a receive happens
  in the schedule between these calls, so it shows as a gap, as in the simulator;
- without a pipeline: each micro-batch's forward (+ loss) and backward, around the loop's own calls;
- the optimizer step, and the whole step.

Times are wall clock (time.time()), so the ranks of one machine share a clock; ranks on other machines
are off by their clock skew (NTP: about a millisecond). On a GPU each span records a pair of CUDA
events on the current stream, resolved after the step's final synchronize, so tracing adds no
synchronisation inside the step. Overhead outside the traced steps: one attribute check per action.

At the end of the run rank 0 gathers every rank's events (one gather_object) and writes, next to the
metrics file, trace.jsonl (one JSON object per span: rank, pp_rank, step, kind, stage, micro_batch,
start, end) and trace.json (a Chrome trace: open it in https://ui.perfetto.dev).
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from fivefold.runtime.config import RunConfig
from fivefold.sim.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from fivefold.spec import Plan

OPTIMIZER = "optimizer"  # the same names as the simulator's events (sim/engine.py)
GRAD_REDUCE = "grad-reduce"
STEP = "step"  # the whole step of one rank
TRACE_FILE = "trace.jsonl"
CHROME_TRACE_FILE = "trace.json"
# `fivefold report` skips the first two steps of a run as warm-up (lazy initialisation, allocator
# growth), so the traced steps are the three after them, or the last ones of a shorter run.
FIRST_TRACED_STEP = 3
TRACED_STEPS = 3


def traced_steps(steps_run: int) -> range:
    """Which of the `steps_run` steps a process runs it traces (1 = its first step, also after a resume):
    3, 4, 5; fewer, later ones, for a short run."""
    first = max(1, min(FIRST_TRACED_STEP, steps_run - 1))
    return range(first, min(first + TRACED_STEPS, steps_run + 1))


class _Clock:
    """Wall-clock spans; on a GPU via CUDA events resolved at the end of the step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.origin_wall = 0.0
        self.origin_perf = 0.0
        self.origin_event: Any = None

    def start_step(self) -> None:
        if self.cuda:  # the stream is idle here (the loop synchronizes at the end of every step)
            torch.cuda.synchronize()
            self.origin_event = torch.cuda.Event(enable_timing=True)
            self.origin_event.record()
        self.origin_wall, self.origin_perf = time.time(), time.perf_counter()

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, mark: Any) -> float:
        """Wall-clock time of a mark (after the step's synchronize on a GPU)."""
        if self.cuda:
            return self.origin_wall + self.origin_event.elapsed_time(mark) / 1e3
        return self.origin_wall + (mark - self.origin_perf)


class StepTracer:
    """Records spans during the traced steps of a run that ends at step `last_step` (None: records
    nothing); see the module docstring."""

    def __init__(self, plan: Plan, rank: int, device: torch.device, last_step: int | None,
                 run_dir: str | Path | None) -> None:
        self.plan, self.rank, self.last_step = plan, rank, last_step
        self.steps = range(0)  # the traced step numbers, known at the first step (a resumed run starts later)
        self.pp_rank = plan.coords(rank)["pp"]
        self.run_dir = Path(run_dir) if run_dir else None
        self.clock = _Clock(device)
        self.active = False
        self.step = 0
        self.marks: list[list[Any]] = []  # [kind, stage, micro_batch, start mark, end mark] of this step
        self.events: list[dict] = []  # resolved spans of every traced step
        if rank == 0 and self.run_dir is not None:  # a trace of an earlier run in this folder is stale
            for name in (TRACE_FILE, CHROME_TRACE_FILE):
                (self.run_dir / name).unlink(missing_ok=True)

    @classmethod
    def for_run(cls, config: RunConfig, plan: Plan, rank: int, device: torch.device, schedule: Any = None) -> StepTracer:
        """The tracer of a training run (RunConfig): records only with config.trace, into the metrics
        file's folder; instruments the pipeline schedule when there is one."""
        tracer = cls(plan, rank, device, config.steps if config.trace else None,
                     Path(config.metrics_file).parent if config.metrics_file else None)
        if config.trace and schedule is not None:
            tracer.instrument(schedule)
        return tracer

    # --- recording -----------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Open 1-based step `step`; the first call fixes which steps are traced."""
        if self.last_step is not None and not self.steps:
            positions = traced_steps(self.last_step - step + 1)
            self.steps = range(step - 1 + positions.start, step - 1 + positions.stop)
        self.step = step
        self.active = step in self.steps
        if self.active:
            self.marks = []
            self.clock.start_step()
            self.step_start = self.clock.mark()

    def end_step(self) -> None:
        """Close the step; call it after the loop's end-of-step synchronize."""
        if not self.active:
            return
        self.marks.append([STEP, -1, -1, self.step_start, self.clock.mark()])
        for kind, stage, micro_batch, start, end in self.marks:
            self.events.append({"rank": self.rank, "pp_rank": self.pp_rank, "step": self.step, "kind": kind,
                                "stage": stage, "micro_batch": micro_batch, "start": self.clock.seconds(start),
                                "end": self.clock.seconds(end)})
        self.active = False

    @contextlib.contextmanager
    def _span(self, kind: str, stage: int, micro_batch: int) -> Iterator[None]:
        start = self.clock.mark()
        try:
            yield
        finally:
            self.marks.append([kind, stage, micro_batch, start, self.clock.mark()])

    def span(self, kind: str, stage: int = -1, micro_batch: int = -1) -> contextlib.AbstractContextManager:
        """Time the enclosed code as one event of this step (nothing when the step is not traced)."""
        return self._span(kind, stage, micro_batch) if self.active else contextlib.nullcontext()

    def instrument(self, schedule: Any) -> None:
        """Time the actions of a torch.distributed.pipelining schedule (see the module docstring)."""
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            index = stage.stage_index
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, lambda a, k: (FORWARD, a[0]), index)
            stage.backward_one_chunk = self._timed(
                stage.backward_one_chunk,
                lambda a, k: (BACKWARD if k.get("full_backward", True) else BACKWARD_INPUT, a[0]), index)
            stage.backward_weight_one_chunk = self._timed(stage.backward_weight_one_chunk,
                                                          lambda a, k: (BACKWARD_WEIGHT, a[0]), index)
            if self.plan.dp * self.plan.cp > 1:  # otherwise there is nothing to reduce
                stage.perform_reduce_grad = self._timed(stage.perform_reduce_grad,
                                                        lambda a, k: (GRAD_REDUCE, -1), index)
        compute_loss = schedule._maybe_compute_loss

        @functools.wraps(compute_loss)
        def loss_in_forward(stage, output, target_mbs, mb_index, *args, **kwargs):
            result = compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
            if self.active and stage.is_last and self.marks and self.marks[-1][0] == FORWARD:
                self.marks[-1][4] = self.clock.mark()  # the loss belongs to the last stage's forward
            return result
        schedule._maybe_compute_loss = loss_in_forward

    def _timed(self, method: Callable, what: Callable[[tuple, dict], tuple[str, int]], stage: int) -> Callable:
        @functools.wraps(method)
        def timed(*args, **kwargs):
            if not self.active:
                return method(*args, **kwargs)
            kind, micro_batch = what(args, kwargs)
            with self._span(kind, stage, micro_batch):
                return method(*args, **kwargs)
        return timed

    # --- output --------------------------------------------------------------------------------

    def finish(self) -> Path | None:
        """Gather every rank's events on rank 0 and write trace.jsonl and trace.json; rank 0 returns the
        trace.jsonl path. A collective: every rank calls it (does nothing when nothing was traced)."""
        if self.last_step is None or self.run_dir is None:
            return None
        world = dist.get_world_size() if dist.is_initialized() else 1
        gathered: list[list[dict]] | None = [[] for _ in range(world)] if self.rank == 0 else None
        if world > 1:
            dist.gather_object(self.events, gathered, dst=0)
        elif gathered is not None:
            gathered[0] = self.events
        if gathered is None:
            return None
        events = sorted((e for rank_events in gathered for e in rank_events),
                        key=lambda e: (e["step"], e["rank"], e["start"]))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / TRACE_FILE
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        (self.run_dir / CHROME_TRACE_FILE).write_text(json.dumps(chrome_trace(self.plan, events)))
        return path


def chrome_trace(plan: Plan, events: list[dict]) -> dict:
    """The measured spans as a Chrome trace: one process per rank, thread 0 the actions, thread 1 steps."""
    origin = min((e["start"] for e in events), default=0.0)
    trace: list[dict] = []
    for rank in range(plan.world_size):
        coords = plan.coords(rank)
        name = f"rank {rank} (" + " ".join(f"{d}{coords[d]}" for d in ("pp", "dp", "cp", "tp")) + ")"
        trace.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": name}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, thread in ((0, "compute"), (1, "step")):
            trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": thread}})
    for e in events:
        if e["kind"] == STEP:
            name = f"step {e['step']}"
        elif e["micro_batch"] >= 0:
            name = f"{e['kind']} s{e['stage']} mb{e['micro_batch']}"
        else:
            name = e["kind"] + (f" s{e['stage']}" if e["stage"] >= 0 else "")
        trace.append({"name": name, "cat": "step" if e["kind"] == STEP else "compute", "ph": "X", "pid": e["rank"],
                      "tid": 1 if e["kind"] == STEP else 0, "ts": (e["start"] - origin) * 1e6,
                      "dur": (e["end"] - e["start"]) * 1e6,
                      "args": {"step": e["step"], "stage": e["stage"], "micro_batch": e["micro_batch"]}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"plan": plan.describe(), "measured": True}}
