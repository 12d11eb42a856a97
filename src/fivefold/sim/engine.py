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
  micro-batches doubles them.

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
from heapq import heappop, heappush
from operator import itemgetter
from typing import NamedTuple

from fivefold.errors import SpecError
from fivefold.sim.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, SPLIT_BACKWARD, Action,
                                    rank_orders, stage_owners)
from fivefold.sim.summary import COMPUTE_KINDS, RankResult, rank_result  # noqa: F401 (COMPUTE_KINDS: re-exported)

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


class Event(NamedTuple):
    """One bar of the timeline (a tuple: hundreds of thousands are made for a big plan)."""

    rank: int  # pp rank
    lane: str  # "compute" or "comm"
    kind: str  # F, B, I, W, optimizer; send-activation, send-gradient, grad-reduce, param-gather, embedding-sync
    start: float  # seconds from the start of the step
    end: float
    stage: int = -1  # virtual stage, -1 when not tied to one
    micro_batch: int = -1  # micro-batch, -1 when not tied to one
    peer: int = -1  # for sends: the receiving pp rank


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
    """Replay one step; see the module docstring for the rules and how it runs."""
    _check(step)
    orders = rank_orders(step.schedule, step.pp, step.virtual_stages, step.micro_batches)
    replay = _Replay(step, orders)
    events, compute_free, collective_free = replay.run()
    owner, last_stage = replay.owner, replay.last_stage
    pipeline_time = max((e.end for e in events if e.lane == "compute"), default=0.0)
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
    by_rank: list[list[Event]] = [[] for _ in range(step.pp)]
    for event in events:
        by_rank[event.rank].append(event)
    for mine in by_rank:  # stable: events of one rank at one instant keep the order they happened in
        mine.sort(key=_START_LANE)
    events = [event for mine in by_rank for event in mine]  # by (rank, start, lane)
    split = step.schedule in SPLIT_BACKWARD
    ranks = [rank_result(step, rank, by_rank[rank], pipeline_time, step_time, split) for rank in range(step.pp)]
    busiest = max(sum(replay.seconds[a.stage][a.kind] for a in actions) for actions in orders)
    return SimResult(step_time_s=step_time, pipeline_time_s=pipeline_time,
                     bubble_fraction=(pipeline_time - busiest) / busiest if busiest > 0 else 0.0,
                     busiest_rank_s=busiest, ranks=ranks, events=events, title=step.title, schedule=step.schedule,
                     micro_batches=step.micro_batches, visits=replay.visits, actions=replay.total)


_START_LANE = itemgetter(3, 1)  # Event.start, Event.lane


# An Event from all its fields without NamedTuple's argument handling: hundreds of thousands per step.
_new_tuple = tuple.__new__


# What a rank's next action can wait for, one table each, indexed (table * stages + stage) * m + micro-batch.
ACTIVATION_IN, GRADIENT_IN, FORWARD_DONE, INPUT_DONE = range(4)


class _Replay:
    """The event loop over one pipeline's action orders (module docstring, "How it runs")."""

    def __init__(self, step: StepInput, orders: list[list[Action]]) -> None:
        self.step, self.orders = step, orders
        self.owner = stage_owners(orders)
        self.last_stage = len(step.stages) - 1
        self.weight_kind = BACKWARD_WEIGHT if step.schedule in SPLIT_BACKWARD else BACKWARD
        # Seconds of each kind of pass per stage, looked up once per action.
        self.seconds = [{FORWARD: t.forward, BACKWARD: t.backward_input + t.backward_weight,
                         BACKWARD_INPUT: t.backward_input, BACKWARD_WEIGHT: t.backward_weight} for t in step.stages]
        self.last_weight_action: dict[int, int] = {}  # stage -> index in its rank's order of its last W (or B)
        for actions in orders:
            for index, action in enumerate(actions):
                if action.kind == self.weight_kind:
                    self.last_weight_action[action.stage] = index
        self.total = sum(len(a) for a in orders)
        self.visits = 0
        self.events: list[Event] = []
        # produced[key]: when an input became available (None: not yet); parked[key]: the rank whose next
        # action waits for it (-1: none). Flat lists: O(1) without hashing, linear in the actions.
        self.table_size = len(step.stages) * step.micro_batches
        self.produced: list[float | None] = [None] * (4 * self.table_size)
        self.parked = [-1] * (4 * self.table_size)
        self.queue: list[tuple[float, int, float, float]] = []  # (start, rank, end, gather start) of ready ones
        self.cursor = [0] * step.pp
        self.link_free: dict[tuple[int, int], float] = {}  # (rank, +1/-1 direction) -> its send link free
        # Gradient reductions and parameter gathers of a rank share its data-parallel communicator: NCCL runs
        # the collectives of one communicator one after another, in the order they are issued.
        self.collective_free = [0.0] * step.pp
        self.compute_free = [0.0] * step.pp
        self.gathered: set[int] = set()  # stages whose weights are gathered right now

    def key(self, table: int, stage: int, micro_batch: int) -> int:
        return table * self.table_size + stage * self.step.micro_batches + micro_batch

    def input_key(self, action: Action) -> int:
        """What the action waits for; -1 when nothing (the first stage's forwards)."""
        kind, stage, micro_batch = action
        at = stage * self.step.micro_batches + micro_batch
        if kind == FORWARD:
            return -1 if stage == 0 else ACTIVATION_IN * self.table_size + at
        if kind == BACKWARD_WEIGHT:
            return INPUT_DONE * self.table_size + at
        if stage == self.last_stage:  # the loss is computed right after the last forward
            return FORWARD_DONE * self.table_size + at
        return GRADIENT_IN * self.table_size + at

    def offer(self, rank: int) -> None:
        """Queue the rank's next action if its input is there, else park the rank under that input."""
        index = self.cursor[rank]
        actions = self.orders[rank]
        if index == len(actions):
            return
        self.visits += 1
        action = actions[index]
        key = self.input_key(action)
        ready = 0.0 if key < 0 else self.produced[key]
        if ready is None:
            self.parked[key] = rank
            return
        start, end, gather_start = self.timing(rank, action, ready)
        heappush(self.queue, (start, rank, end, gather_start))

    def publish(self, key: int, time: float) -> None:
        self.produced[key] = time
        rank = self.parked[key]
        if rank >= 0:
            self.offer(rank)

    def gather_before(self, action: Action) -> float:
        """Seconds of parameter gathering this action waits for (0 when none)."""
        gather = self.step.stages[action.stage].param_gather
        if gather <= 0 or action.kind == BACKWARD_WEIGHT or action.stage in self.gathered:
            return 0.0
        return gather

    def timing(self, rank: int, action: Action, ready: float) -> tuple[float, float, float]:
        """(start, end, gather start) of an action whose input is ready at `ready`. Depends only on the
        rank's own state, which changes only when the rank runs an action: valid until it is popped."""
        start = max(ready, self.compute_free[rank])
        duration = self.seconds[action.stage][action.kind]
        gather = self.gather_before(action)
        if gather <= 0:
            return start, start + duration, -1.0
        times = self.step.stages[action.stage]
        # Once-per-step gathers are issued at t=0; per-pass gathers when the pass could otherwise start.
        issue = start if times.reshard_after_forward or times.reshard_after_backward else 0.0
        gather_start = max(self.collective_free[rank], issue)
        if not self.step.overlap_param_gather:
            start = max(start, gather_start + gather)
            return start, start + duration, gather_start
        layers = max(1, times.buckets)
        start = max(start, gather_start + gather / layers)
        return start, max(start + duration, gather_start + gather + duration / layers), gather_start

    def ship(self, rank: int, target_stage: int, kind: str, micro_batch: int, end: float, seconds: float) -> None:
        """Hand an activation (kind F) or a gradient (kind B) produced at `end` to `target_stage`."""
        target_rank = self.owner[target_stage]
        key = self.key(ACTIVATION_IN if kind == FORWARD else GRADIENT_IN, target_stage, micro_batch)
        if target_rank == rank:
            self.publish(key, end)
            return
        direction = 1 if target_rank > rank else -1
        start = max(end, self.link_free.get((rank, direction), 0.0))
        self.link_free[rank, direction] = start + seconds
        if not self.step.async_p2p:  # a blocking send holds the sender until the receiver has it
            self.compute_free[rank] = max(self.compute_free[rank], start + seconds)
        self.events.append(_new_tuple(Event, (rank, "comm", SEND_ACTIVATION if kind == FORWARD else SEND_GRADIENT,
                                              start, start + seconds, target_stage, micro_batch, target_rank)))
        self.publish(key, start + seconds)

    def run(self) -> tuple[list[Event], list[float], list[float]]:
        """Replay every action; (events, compute free, collective free per rank)."""
        step, events, queue, orders, cursor = self.step, self.events, self.queue, self.orders, self.cursor
        stages, last_stage, publish, ship = step.stages, self.last_stage, self.publish, self.ship
        for rank in range(step.pp):
            self.offer(rank)
        done = 0
        while queue:
            start, rank, end, gather_start = heappop(queue)
            index = cursor[rank]
            action = orders[rank][index]
            kind, stage, micro_batch = action
            times = stages[stage]
            if gather_start >= 0:
                gather_end = gather_start + self.gather_before(action)
                self.collective_free[rank] = gather_end
                events.append(Event(rank, "comm", PARAM_GATHER, gather_start, gather_end, stage, micro_batch))
            if times.param_gather > 0 and kind != BACKWARD_WEIGHT:
                frees = times.reshard_after_forward if kind == FORWARD else times.reshard_after_backward
                (self.gathered.discard if frees else self.gathered.add)(stage)
            self.compute_free[rank] = end
            cursor[rank] = index + 1
            done += 1
            events.append(_new_tuple(Event, (rank, "compute", kind, start, end, stage, micro_batch, -1)))
            if kind == FORWARD:
                if stage < last_stage:
                    ship(rank, stage + 1, FORWARD, micro_batch, end, times.send_activation)
                else:
                    publish(self.key(FORWARD_DONE, stage, micro_batch), end)
            elif kind == BACKWARD_INPUT:
                publish(self.key(INPUT_DONE, stage, micro_batch), end)
            if (kind == BACKWARD or kind == BACKWARD_INPUT) and stage > 0:
                ship(rank, stage - 1, BACKWARD, micro_batch, end, stages[stage - 1].send_activation)
            if times.grad_reduce > 0 and ((times.reduce_every_micro_batch and kind == self.weight_kind)
                                          or self.last_weight_action.get(stage) == index):
                self.reduce(rank, action, start, end)
            self.offer(rank)
        self.visits += done
        if done < self.total:
            stuck = [str(self.orders[r][self.cursor[r]]) for r in range(step.pp)
                     if self.cursor[r] < len(self.orders[r])]
            raise RuntimeError(f"schedule {step.schedule} deadlocks at {stuck}")
        return events, self.compute_free, self.collective_free

    def reduce(self, rank: int, action: Action, start: float, end: float) -> None:
        """The data-parallel gradient reduction after a weight-gradient action (module docstring)."""
        times = self.step.stages[action.stage]
        if self.step.overlap_grad_reduce:
            buckets = max(1, times.buckets)  # ready one by one while this action runs
            reduce_start = max(self.collective_free[rank], start + (end - start) / buckets)
            reduce_end = max(reduce_start + times.grad_reduce, end + times.grad_reduce / buckets)
        else:  # after the backward, and the rank waits for it
            reduce_start = max(self.collective_free[rank], end)
            reduce_end = reduce_start + times.grad_reduce
            self.compute_free[rank] = reduce_end
        self.collective_free[rank] = reduce_end
        self.events.append(Event(rank, "comm", GRAD_REDUCE, reduce_start, reduce_end,
                                 action.stage, action.micro_batch if times.reduce_every_micro_batch else -1))


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
