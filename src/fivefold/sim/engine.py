"""Event-driven replay of one training step of one pipeline, rank by rank.

Every pp rank runs the action order of its schedule (sim/schedules.py) on its compute stream. An action
starts when the rank is free and its input is there: a forward needs the previous stage's activation,
a backward the next stage's gradient, a W pass its own I pass. Actions are taken in order of their start
time across all ranks, so shared resources (the send links, the collective stream) serve requests in
the order they happen, as a discrete-event simulation does.

How it runs (cost linear in the number of actions A = p * v * m * passes):
- a priority queue holds the ready actions, at most one per rank (its next one), keyed by (start, rank);
  the engine pops the earliest, runs it, and publishes what it produces (an activation or gradient arriving
  at a time, an I pass done).
- a rank whose next action's input is not produced yet is parked under that input's key; publishing the key
  wakes exactly that rank. No rank is ever polled.
- so each action is visited at most three times (offered when it becomes its rank's next, woken once,
  popped once) and costs O(log p) for the queue: time O(A log p), memory O(A) for the events.
  `SimResult.visits` counts the visits; tests/test_sim_engine.py checks the bound and that doubling the
  micro-batches doubles them. The loop itself is sim/replay.py.
- replicas that differ (`simulate_replicas`) each replay their pipeline; a gradient reduction is one
  collective over them, so each replica's reduction takes the latest start and end of all; a few rounds
  of replays agree on those (each round only moves them later).

Communication runs beside compute, as the runtime issues it:
- point-to-point: a finished forward (backward) ships its activation (gradient) asynchronously on the
  sender's link towards the next (previous) rank; the receiver's action waits for its arrival. Sends in one
  direction from one rank go one after another. Stages on the same rank hand over for free.
- gradient reduction (DDP all-reduce, ZeRO reduce-scatter) of a stage runs on the rank's data-parallel
  communicator (one collective at a time, in issue order, shared with the parameter gathers) after its
  weight-gradient action (B, or W for zero-bubble schedules): once per step after the last one
  (ZeRO-0/1; torch's REDUCE_GRAD follows it) or after every one (ZeRO-2/3). Which one, per stack and
  ZeRO level, is cost.stack.data_parallel_sync's answer, shared with the estimate. Buckets (about one per
  layer) become ready one by one: the reduction starts once the first bucket is ready and cannot end
  before the last bucket, ready when the action ends, is reduced. Compute never waits for it, the
  optimizer does (and a later gather queued behind it on the communicator).
- parameter all-gathers run on the same communicator, layer by layer ahead of the compute that needs
  them. A stage's weights start the step sharded; a forward or backward (F, B, I; W needs no weights)
  gathers them when they are sharded, and afterwards they stay gathered unless the stage reshards after
  that kind of pass (FSDP2's reshard_after_forward / reshard_after_backward). A stage that never
  reshards (ZeRO-1/2) gathers once per step, issued at t=0 (prefetched under the first forward); other
  gathers are issued when the pass could otherwise start: ZeRO-3 resharding after both kinds of pass
  gathers before every forward and backward. A pass over L layers whose gather starts at g0 starts after
  the first layer's share (g0 + G/L) and ends no earlier than the gather plus one layer of compute
  (g0 + G + D/L).
- tied embeddings with pp > 1: the first and last stage's ranks all-reduce the embedding gradient when
  both are done reducing, before their optimizer steps.
- the optimizer steps start when every rank's compute is done and its collectives have landed: the
  runtime clips gradients by their global norm, an all-reduce over all ranks.
- a SoftwareStack that does not overlap (overlap_grad_reduce / overlap_param_gather / async_p2p off)
  makes the rank wait instead: reduction after the backward, the whole gather before the pass, the
  sender until its send is through. torch.distributed.pipelining with FSDP2 (the `fivefold` stack under
  pp > 1) is of this kind: REDUCE_GRAD runs after a stage's last backward and the compute stream waits.

Memory of a rank over time: static bytes of its stages and its base bytes (workspaces, transient
buffers) plus the activation bytes of every micro-batch from the start of its forward until its backward
(W for zero-bubble schedules) ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Sequence

from fivefold.errors import SpecError
from fivefold.sim.replay import Replay
from fivefold.sim.step_input import (CONTEXT_EXCHANGE, EMBEDDING_SYNC, GRAD_REDUCE, OPTIMIZER,  # noqa: F401 (re-exported)
                                     VOCAB_COLLECTIVES,
                                     PARAM_GATHER, SEND_ACTIVATION, SEND_GRADIENT, Event, StageTimes, StepInput)
from fivefold.sim.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,  # noqa: F401 (re-exported)
                                    SPLIT_BACKWARD, rank_orders)
from fivefold.sim.summary import COMPUTE_KINDS, RankResult, rank_result  # noqa: F401 (COMPUTE_KINDS: re-exported)


@dataclass
class SimResult:
    """One simulated step: its length, its pipeline bubble, every rank and every event."""

    step_time_s: float  # start of the step to the last optimizer end
    pipeline_time_s: float  # start of the step to the last F/B/I/W end on any rank
    bubble_fraction: float  # (pipeline time - busiest rank's F/B/I/W time) / that time: (p-1)/m for 1F1B
    busiest_rank_s: float  # F/B/I/W seconds of the busiest rank: the pipeline time without bubble
    ranks: list[RankResult]
    events: list[Event]
    title: str = ""
    schedule: str = ""
    micro_batches: int = 0
    visits: int = 0  # how often the engine looked at an action (at most 3 per action, see the docstring)
    actions: int = 0  # F/B/I/W actions replayed
    replicas: int = 1  # distinct data-parallel replicas simulated: rows are replica-major (replica * pp + rank)
    outer: dict | None = None  # DiLoCo (sim/diloco.py): the outer cycle drawn; step_time_s is then its length

    @property
    def peak_memory_bytes(self) -> float:
        return max(r.peak_memory_bytes for r in self.ranks)

    def to_dict(self) -> dict:
        return {"title": self.title, "schedule": self.schedule, "micro_batches": self.micro_batches,
                "replicas": self.replicas, "step_time_s": self.step_time_s, "pipeline_time_s": self.pipeline_time_s,
                "bubble_fraction": self.bubble_fraction,
                "bubble_share_of_step": ((self.pipeline_time_s - self.busiest_rank_s) / self.step_time_s
                                         if self.step_time_s else 0.0),
                "peak_memory_bytes": self.peak_memory_bytes,
                "ranks": [{"rank": r.rank, "label": r.label, "busy_s": r.busy_s, "comm_s": r.comm_s,
                           "exposed_comm_s": r.exposed_comm_s, "idle_s": r.idle_s,
                           "busy_share": r.busy_s / self.step_time_s if self.step_time_s else 0.0,
                           "comm_share": r.exposed_comm_s / self.step_time_s if self.step_time_s else 0.0,
                           "idle_share": r.idle_s / self.step_time_s if self.step_time_s else 0.0,
                           "bubble_fraction": r.bubble_fraction, "peak_memory_bytes": r.peak_memory_bytes}
                          for r in self.ranks], **({"diloco": self.outer} if self.outer else {})}


def simulate(step: StepInput) -> SimResult:
    """Replay one step of one pipeline; see the module docstring for the rules and how it runs."""
    return simulate_replicas((step,))


MAX_ROUNDS = 50  # agreement rounds between replicas; each pushes shared reductions later, never earlier


def simulate_replicas(steps: Sequence[StepInput]) -> SimResult:
    """Replay one step of data-parallel replicas that differ (stage times from different devices, different
    micro-batch counts): rows are replica 0's pp ranks, then replica 1's, and so on.

    Each replica's pipeline runs on its own; each gradient reduction is one collective over all of them
    (the runtime's all-reduce or reduce-scatter): it starts when the last replica issues it and ends when
    the last replica's share is through; the i-th reduction of a stage on one replica meets the i-th on the
    others (a replica with more micro-batches has unmatched extra ones under ZeRO-2/3). Found by rounds:
    replay every replica, agree on each reduction's latest (start, end), replay with those as floors, until
    no replica moves them. The optimizer starts after the global gradient norm, over every rank of every
    replica, so the step ends when the slowest replica's reduction does."""
    if not steps:
        raise SpecError("replicas", 0, "simulate at least one replica")
    for step in steps:
        _check(step)
    first = steps[0]
    if any((s.schedule, s.pp, s.virtual_stages) != (first.schedule, first.pp, first.virtual_stages) for s in steps):
        raise SpecError("replicas", [(s.schedule, s.pp, s.virtual_stages) for s in steps],
                        "every replica runs the same schedule over the same pp ranks and stages")
    orders = [rank_orders(s.schedule, s.pp, s.virtual_stages, s.micro_batches) for s in steps]
    joint: dict[tuple[int, int, int], tuple[float, float]] = {}
    for _ in range(MAX_ROUNDS):
        replays = [Replay(step, order, joint, row=index * first.pp)
                   for index, (step, order) in enumerate(zip(steps, orders))]
        for replay in replays:
            replay.run()
        agreed: dict[tuple[int, int, int], tuple[float, float]] = {}
        for replay in replays:
            for key, (start, end) in replay.reductions.items():
                low, high = agreed.get(key, (start, end))
                agreed[key] = (max(low, start), max(high, end))
        if all(replay.reductions[key] == agreed[key] for replay in replays for key in replay.reductions):
            break
        joint = agreed
    else:
        raise RuntimeError(f"replica reductions did not settle in {MAX_ROUNDS} rounds")
    return _finish(steps, replays)


def _finish(steps: Sequence[StepInput], replays: list[Replay]) -> SimResult:
    """Tied-embedding all-reduce, optimizer, per-row summaries of replayed replicas."""
    pp = steps[0].pp
    events = [event for replay in replays for event in replay.events]
    pipeline_time = max((e.end for e in events if e.lane == "compute"), default=0.0)
    ready = [max(c, g) for replay in replays for c, g in zip(replay.compute_free, replay.collective_free)]
    for index, (step, replay) in enumerate(zip(steps, replays)):
        if step.tied_embedding_sync > 0 and step.pp > 1:
            ends = sorted({replay.row + replay.owner[0], replay.row + replay.owner[replay.last_stage]})
            sync_start = max(ready[row] for row in ends)
            for row in ends:
                events.append(Event(row, "comm", EMBEDDING_SYNC, sync_start, sync_start + step.tied_embedding_sync))
                ready[row] = sync_start + step.tied_embedding_sync
    # The runtime clips gradients by their global norm (one all-reduce of a scalar over all ranks), so
    # every optimizer step starts once the last rank's gradients are reduced.
    optimizer_start = max(ready)
    done = []
    for row in range(len(ready)):
        step = steps[row // pp]
        optimizer = step.optimizer[row % pp] if step.optimizer else 0.0
        if optimizer > 0:
            events.append(Event(row, "compute", OPTIMIZER, optimizer_start, optimizer_start + optimizer))
        done.append(optimizer_start + optimizer)
    step_time = max(done)
    by_row: list[list[Event]] = [[] for _ in ready]
    for event in events:
        by_row[event.rank].append(event)
    for mine in by_row:  # stable: events of one rank at one instant keep the order they happened in
        mine.sort(key=_START)
    events = [event for mine in by_row for event in mine]  # by (row, start)
    split = steps[0].schedule in SPLIT_BACKWARD
    ranks = [rank_result(steps[row // pp], row % pp, row, by_row[row], pipeline_time, step_time, split)
             for row in range(len(ready))]
    busiest = max(sum(replay.seconds[a.stage][a.kind] for a in actions)
                  for replay in replays for actions in replay.orders)
    return SimResult(step_time_s=step_time, pipeline_time_s=pipeline_time,
                     bubble_fraction=(pipeline_time - busiest) / busiest if busiest > 0 else 0.0,
                     busiest_rank_s=busiest, ranks=ranks, events=events, title=steps[0].title,
                     schedule=steps[0].schedule, micro_batches=max(s.micro_batches for s in steps),
                     visits=sum(r.visits for r in replays), actions=sum(r.total for r in replays),
                     replicas=len(steps))


_START = itemgetter(3)  # Event.start


def _check(step: StepInput) -> None:
    expected = step.pp * step.virtual_stages
    if len(step.stages) != expected:
        raise SpecError("stages", len(step.stages), f"needs one StageTimes per virtual stage ({expected})")
    for index, times in enumerate(step.stages):
        for name in ("forward", "backward_input", "backward_weight", "send_activation", "grad_reduce",
                     "param_gather"):
            value = getattr(times, name)
            if not value >= 0:
                raise SpecError(f"stages[{index}].{name}", value, "must be a time >= 0 seconds")
    if step.optimizer and len(step.optimizer) != step.pp:
        raise SpecError("optimizer", len(step.optimizer), f"needs one time per pp rank ({step.pp})")
    if step.rank_base_bytes and len(step.rank_base_bytes) != step.pp:
        raise SpecError("rank_base_bytes", len(step.rank_base_bytes), f"needs one number per pp rank ({step.pp})")
