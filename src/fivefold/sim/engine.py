"""Event-driven replay of one training step of one pipeline, rank by rank.

Every pp rank runs the action order of its schedule (sim/schedules.py) on its compute stream. An action
starts when the rank is free and its input is there: a forward needs the previous stage's activation,
a backward the next stage's gradient, a W pass its own I pass. Actions are taken in order of their start
time across all ranks, so shared resources (the send links, the collective stream) serve requests in
the order they happen, as a discrete-event simulation does.

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

from dataclasses import dataclass, field

from fivefold.errors import SpecError
from fivefold.sim.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, SPLIT_BACKWARD, Action,
                                    rank_orders, stage_owners)

COMPUTE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
OPTIMIZER = "optimizer"
SEND_ACTIVATION = "send-activation"
SEND_GRADIENT = "send-gradient"
GRAD_REDUCE = "grad-reduce"
PARAM_GATHER = "param-gather"
EMBEDDING_SYNC = "embedding-sync"


@dataclass(frozen=True)
class StageTimes:
    """What one virtual stage costs for one micro-batch (seconds, bytes)."""

    forward: float  # forward compute (+ its exposed tp/cp/ep communication)
    backward_input: float  # input-gradient part of the backward (+ recompute forward, if any)
    backward_weight: float  # weight-gradient part of the backward
    send_activation: float = 0.0  # p2p time of one activation to the next stage (the gradient back: same)
    activation_bytes: float = 0.0  # memory held per in-flight micro-batch
    static_bytes: float = 0.0  # parameters + gradients + optimizer states of this stage
    grad_reduce: float = 0.0  # one data-parallel reduction of this stage's gradients
    reduce_every_micro_batch: bool = False  # ZeRO-2/3: after every backward; else once, after the last
    param_gather: float = 0.0  # one all-gather of this stage's parameters
    reshard_after_forward: bool = False  # weights freed after a forward (ZeRO-3): the next pass gathers
    reshard_after_backward: bool = False  # weights freed after a backward: the next forward gathers
    buckets: int = 1  # layers: gradient buckets / gathered modules that are ready one by one


@dataclass(frozen=True)
class StepInput:
    """Everything the engine needs to replay one step of one pipeline."""

    schedule: str  # gpipe | 1f1b | interleaved-1f1b | zb-h1 | zbv
    pp: int  # pipeline ranks
    virtual_stages: int  # stages per rank
    micro_batches: int  # micro-batches per step
    stages: tuple[StageTimes, ...]  # one per virtual stage, in model order
    optimizer: tuple[float, ...] = ()  # optimizer step seconds per pp rank; () = none
    tied_embedding_sync: float = 0.0  # all-reduce of the tied embedding gradient, first <-> last stage
    rank_base_bytes: tuple[float, ...] = ()  # memory per pp rank besides states and activations
    overlap_grad_reduce: bool = True  # reduce bucket by bucket under the backward; else after it, blocking
    overlap_param_gather: bool = True  # gather layer by layer ahead of compute; else the pass waits for all
    async_p2p: bool = True  # sends run beside compute; else the sender waits until its send is through
    rank_labels: tuple[str, ...] = ()  # how to name each pp rank in pictures; () = "pp0", "pp1", ...
    title: str = ""  # one line naming the plan


@dataclass(frozen=True)
class Event:
    """One bar of the timeline."""

    rank: int  # pp rank
    lane: str  # "compute" or "comm"
    kind: str  # F, B, I, W, optimizer; send-activation, send-gradient, grad-reduce, param-gather, embedding-sync
    start: float  # seconds from the start of the step
    end: float
    stage: int = -1  # virtual stage, -1 when not tied to one
    micro_batch: int = -1  # micro-batch, -1 when not tied to one
    peer: int = -1  # for sends: the receiving pp rank


@dataclass
class RankResult:
    """What one pp rank did during the step."""

    rank: int
    label: str
    busy_s: float  # compute: F/B/I/W and the optimizer
    comm_s: float  # communication issued by this rank, overlapped or not
    exposed_comm_s: float  # communication while the compute stream had nothing to do
    idle_s: float  # neither computing nor communicating: waiting for other ranks
    bubble_fraction: float  # (pipeline time - own F/B/I/W time) / own F/B/I/W time
    peak_memory_bytes: float
    memory: list[tuple[float, float]] = field(default_factory=list)  # (time, bytes) steps


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

    @property
    def peak_memory_bytes(self) -> float:
        return max(r.peak_memory_bytes for r in self.ranks)

    def to_dict(self) -> dict:
        return {"title": self.title, "schedule": self.schedule, "micro_batches": self.micro_batches,
                "step_time_s": self.step_time_s, "pipeline_time_s": self.pipeline_time_s,
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
                          for r in self.ranks]}


def simulate(step: StepInput) -> SimResult:
    """Replay one step; see the module docstring for the rules."""
    _check(step)
    orders = rank_orders(step.schedule, step.pp, step.virtual_stages, step.micro_batches)
    owner = stage_owners(orders)
    last_stage = len(step.stages) - 1
    split = step.schedule in SPLIT_BACKWARD
    weight_kind = BACKWARD_WEIGHT if split else BACKWARD
    last_weight_action = {}  # stage -> index in its rank's order of its last weight-gradient action
    for actions in orders:
        for index, action in enumerate(actions):
            if action.kind == weight_kind:
                last_weight_action[action.stage] = index

    events: list[Event] = []
    finished: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> end on its rank
    arrived: dict[tuple[str, int, int], float] = {}  # (F|B, stage, micro-batch) -> input there
    link_free: dict[tuple[int, int], float] = {}  # (rank, +1/-1 direction) -> when its send link is free
    # Gradient reductions and parameter gathers of a rank share its data-parallel communicator: NCCL runs
    # the collectives of one communicator one after another, in the order they are issued.
    collective_free = [0.0] * step.pp
    compute_free = [0.0] * step.pp
    gathered: set[int] = set()  # stages whose weights are gathered right now

    def input_ready(action: Action) -> float | None:
        """When the action's input is on its rank; None while it is not yet produced."""
        key = action.stage, action.micro_batch
        if action.kind == FORWARD:
            return 0.0 if action.stage == 0 else arrived.get((FORWARD, *key))
        if action.kind == BACKWARD_WEIGHT:
            return finished.get((BACKWARD_INPUT, *key))
        if action.stage == last_stage:  # the loss is computed right after the last forward
            return finished.get((FORWARD, *key))
        return arrived.get((BACKWARD, *key))

    def compute_seconds(action: Action) -> float:
        times = step.stages[action.stage]
        if action.kind == FORWARD:
            return times.forward
        if action.kind == BACKWARD:
            return times.backward_input + times.backward_weight
        return times.backward_input if action.kind == BACKWARD_INPUT else times.backward_weight

    def gather_before(action: Action) -> float:
        """Seconds of parameter gathering this action waits for (0 when none)."""
        times = step.stages[action.stage]
        if times.param_gather <= 0 or action.kind == BACKWARD_WEIGHT or action.stage in gathered:
            return 0.0
        return times.param_gather

    def reshards(times: StageTimes) -> bool:
        return times.reshard_after_forward or times.reshard_after_backward

    def timing(rank: int, action: Action, ready: float) -> tuple[float, float, float]:
        """(start, end, gather start) of an action whose input is ready at `ready`."""
        start = max(ready, compute_free[rank])
        duration = compute_seconds(action)
        gather = gather_before(action)
        if gather <= 0:
            return start, start + duration, -1.0
        # Once-per-step gathers are issued at t=0; per-pass gathers when the pass could otherwise start.
        issue = start if reshards(step.stages[action.stage]) else 0.0
        gather_start = max(collective_free[rank], issue)
        if not step.overlap_param_gather:
            start = max(start, gather_start + gather)
            return start, start + duration, gather_start
        layers = max(1, step.stages[action.stage].buckets)
        start = max(start, gather_start + gather / layers)
        return start, max(start + duration, gather_start + gather + duration / layers), gather_start

    def ship(rank: int, target_stage: int, kind: str, micro_batch: int, end: float, seconds: float) -> None:
        """Hand an activation (kind F) or a gradient (kind B) produced at `end` to `target_stage`."""
        target_rank = owner[target_stage]
        if target_rank == rank:
            arrived[kind, target_stage, micro_batch] = end
            return
        direction = 1 if target_rank > rank else -1
        start = max(end, link_free.get((rank, direction), 0.0))
        link_free[rank, direction] = start + seconds
        arrived[kind, target_stage, micro_batch] = start + seconds
        if not step.async_p2p:  # a blocking send holds the sender until the receiver has it
            compute_free[rank] = max(compute_free[rank], start + seconds)
        events.append(Event(rank, "comm", SEND_ACTIVATION if kind == FORWARD else SEND_GRADIENT,
                            start, start + seconds, target_stage, micro_batch, peer=target_rank))

    cursor = [0] * step.pp
    remaining = sum(len(a) for a in orders)
    while remaining:
        # Discrete-event order: of the actions whose inputs exist, run the one that starts first.
        best: tuple[float, int, float, float] | None = None
        for rank, actions in enumerate(orders):
            if cursor[rank] == len(actions):
                continue
            ready = input_ready(actions[cursor[rank]])
            if ready is not None:
                start, end, gather_start = timing(rank, actions[cursor[rank]], ready)
                if best is None or start < best[0]:
                    best = (start, rank, end, gather_start)
        if best is None:
            stuck = [str(orders[r][cursor[r]]) for r in range(step.pp) if cursor[r] < len(orders[r])]
            raise RuntimeError(f"schedule {step.schedule} deadlocks at {stuck}")
        start, rank, end, gather_start = best
        index = cursor[rank]
        action = orders[rank][index]
        times = step.stages[action.stage]
        if gather_start >= 0:
            gather_end = gather_start + gather_before(action)
            collective_free[rank] = gather_end
            events.append(Event(rank, "comm", PARAM_GATHER, gather_start, gather_end, action.stage,
                                action.micro_batch))
        if times.param_gather > 0 and action.kind != BACKWARD_WEIGHT:
            frees = times.reshard_after_forward if action.kind == FORWARD else times.reshard_after_backward
            (gathered.discard if frees else gathered.add)(action.stage)
        compute_free[rank] = end
        cursor[rank] += 1
        remaining -= 1
        finished[action.kind, action.stage, action.micro_batch] = end
        events.append(Event(rank, "compute", action.kind, start, end, action.stage, action.micro_batch))
        if action.kind == FORWARD and action.stage < last_stage:
            ship(rank, action.stage + 1, FORWARD, action.micro_batch, end, times.send_activation)
        if action.kind in (BACKWARD, BACKWARD_INPUT) and action.stage > 0:
            previous = step.stages[action.stage - 1]
            ship(rank, action.stage - 1, BACKWARD, action.micro_batch, end, previous.send_activation)
        reduces_now = times.reduce_every_micro_batch and action.kind == weight_kind
        if times.grad_reduce > 0 and (reduces_now or last_weight_action.get(action.stage) == index):
            if step.overlap_grad_reduce:
                buckets = max(1, times.buckets)  # ready one by one while this action runs
                reduce_start = max(collective_free[rank], start + (end - start) / buckets)
                reduce_end = max(reduce_start + times.grad_reduce, end + times.grad_reduce / buckets)
            else:  # after the backward, and the rank waits for it
                reduce_start = max(collective_free[rank], end)
                reduce_end = reduce_start + times.grad_reduce
                compute_free[rank] = reduce_end
            collective_free[rank] = reduce_end
            events.append(Event(rank, "comm", GRAD_REDUCE, reduce_start, reduce_end, action.stage,
                                action.micro_batch if times.reduce_every_micro_batch else -1))

    pipeline_time = max(e.end for e in events if e.lane == "compute")
    ready = [max(compute_free[r], collective_free[r]) for r in range(step.pp)]
    if step.tied_embedding_sync > 0 and step.pp > 1:
        ends = sorted({owner[0], owner[last_stage]})
        sync_start = max(ready[r] for r in ends)
        for r in ends:
            events.append(Event(r, "comm", EMBEDDING_SYNC, sync_start, sync_start + step.tied_embedding_sync))
            ready[r] = sync_start + step.tied_embedding_sync
    # The runtime clips gradients by their global norm (one all-reduce of a scalar over all ranks), so
    # every optimizer step starts once the last rank's gradients are reduced.
    optimizer_start = max(ready)
    for rank in range(step.pp):
        optimizer = step.optimizer[rank] if step.optimizer else 0.0
        if optimizer > 0:
            events.append(Event(rank, "compute", OPTIMIZER, optimizer_start, optimizer_start + optimizer))
        compute_free[rank] = optimizer_start + optimizer
    step_time = max(compute_free)
    events.sort(key=lambda e: (e.rank, e.start, e.lane))
    ranks = [_rank_result(step, rank, orders[rank], events, pipeline_time, step_time, split)
             for rank in range(step.pp)]
    busiest = max(sum(compute_seconds(a) for a in actions) for actions in orders)
    return SimResult(step_time_s=step_time, pipeline_time_s=pipeline_time,
                     bubble_fraction=(pipeline_time - busiest) / busiest if busiest > 0 else 0.0,
                     busiest_rank_s=busiest, ranks=ranks, events=events, title=step.title, schedule=step.schedule,
                     micro_batches=step.micro_batches)


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


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def _rank_result(step: StepInput, rank: int, actions: list[Action], events: list[Event], pipeline_time: float,
                 step_time: float, split: bool) -> RankResult:
    mine = [e for e in events if e.rank == rank]
    compute = _merge([(e.start, e.end) for e in mine if e.lane == "compute"])
    comm = _merge([(e.start, e.end) for e in mine if e.lane == "comm"])
    busy = sum(e.end - e.start for e in mine if e.lane == "compute")
    comm_total = sum(end - start for start, end in comm)
    covered = sum(end - start for start, end in _merge(compute + comm))
    exposed = covered - sum(end - start for start, end in compute)
    own_pipeline = sum(e.end - e.start for e in mine if e.kind in COMPUTE_KINDS)
    label = step.rank_labels[rank] if step.rank_labels else f"pp{rank}"
    memory = _memory_curve(step, rank, actions, mine, split)
    return RankResult(rank=rank, label=label, busy_s=busy, comm_s=comm_total, exposed_comm_s=exposed,
                      idle_s=max(0.0, step_time - covered),
                      bubble_fraction=(pipeline_time - own_pipeline) / own_pipeline if own_pipeline else 0.0,
                      peak_memory_bytes=max(b for _, b in memory), memory=memory)


def _memory_curve(step: StepInput, rank: int, actions: list[Action], mine: list[Event],
                  split: bool) -> list[tuple[float, float]]:
    """(time, bytes) after each change: activations live from forward start to backward (W) end."""
    stages = sorted({a.stage for a in actions})
    base = sum(step.stages[s].static_bytes for s in stages)
    base += step.rank_base_bytes[rank] if step.rank_base_bytes else 0.0
    releases_activation = BACKWARD_WEIGHT if split else BACKWARD
    changes: list[tuple[float, float]] = []
    for event in mine:
        if event.lane != "compute" or event.stage < 0:
            continue
        if event.kind == FORWARD:
            changes.append((event.start, step.stages[event.stage].activation_bytes))
        elif event.kind == releases_activation:
            changes.append((event.end, -step.stages[event.stage].activation_bytes))
    changes.sort(key=lambda c: (c[0], c[1]))  # frees before allocations at the same instant
    curve, level = [(0.0, base)], base
    for time, delta in changes:
        level += delta
        if curve[-1][0] == time:  # one point per instant: frees and allocations at once net out
            curve[-1] = (time, level)
        else:
            curve.append((time, level))
    return curve
