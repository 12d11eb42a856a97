"""The event loop of the simulator (sim/engine.py, "How it runs"): one replica's pipeline, rank by rank.

A priority queue holds each rank's next action once its input is there, keyed by (start, rank); a rank
whose next input is missing is parked under it and woken when it is published. Each action is visited at
most three times. Gradient reductions that several replicas share take the `joint` (start, end) the
caller agreed on (sim/engine.simulate_replicas).
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import Sequence

from fivefold.sim.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, SPLIT_BACKWARD, Action,
                                    stage_owners)
from fivefold.sim.step_input import Event, StepInput  # noqa: F401 (Event: re-exported)
from fivefold.sim.step_input import (CONTEXT_EXCHANGE, EMBEDDING_SYNC, GRAD_REDUCE, VOCAB_COLLECTIVES,  # noqa: F401
                                     OPTIMIZER, PARAM_GATHER, SEND_ACTIVATION, SEND_GRADIENT)

# An Event from all its fields without NamedTuple's argument handling: hundreds of thousands per step.
_new_tuple = tuple.__new__


# What a rank's next action can wait for, one table each, indexed (table * stages + stage) * m + micro-batch.
ACTIVATION_IN, GRADIENT_IN, FORWARD_DONE, INPUT_DONE = range(4)


class Replay:
    """The event loop over one pipeline's action orders (module docstring, "How it runs")."""

    def __init__(self, step: StepInput, orders: Sequence[Sequence[Action]],
                 joint: dict[tuple[int, int, int], tuple[float, float]] | None = None, row: int = 0) -> None:
        self.step, self.orders = step, orders
        self.row = row  # events of pp rank r are drawn on row + r
        # (rank, stage, i) -> the (start, end) floors of the i-th reduction of that stage, agreed between replicas
        self.joint = joint or {}
        self.reductions: dict[tuple[int, int, int], tuple[float, float]] = {}  # the same key -> what it did
        self.reduce_count: dict[tuple[int, int], int] = {}  # (rank, stage) -> reductions so far
        owner = stage_owners(orders)
        self.owner = [owner[stage] for stage in range(len(step.stages))]  # stage -> pp rank
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
        self.gathers = any(t.param_gather > 0 for t in step.stages)
        self.visits = 0
        self.events: list[Event] = []
        # produced[key]: when an input became available (None: not yet); parked[key]: the rank whose next
        # action waits for it (-1: none). Flat lists: O(1) without hashing, linear in the actions.
        self.table_size = len(step.stages) * step.micro_batches
        self.produced: list[float | None] = [None] * (4 * self.table_size)
        self.parked = [-1] * (4 * self.table_size)
        self.queue: list[tuple[float, int, float, float]] = []  # (start, rank, end, gather start) of ready ones
        self.cursor = [0] * step.pp
        self.link_free = [0.0] * (2 * step.pp)  # 2 rank + (1 towards higher ranks) -> when that send link is free
        self.async_p2p = step.async_p2p
        # Gradient reductions and parameter gathers of a rank share its data-parallel communicator: NCCL runs
        # the collectives of one communicator one after another, in the order they are issued.
        self.collective_free = [0.0] * step.pp
        self.compute_free = [0.0] * step.pp
        self.gathered: set[int] = set()  # stages whose weights are gathered right now

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
        if self.gathers:
            start, end, gather_start = self.timing(rank, action, ready)
        else:  # the common case, inlined: no parameter gathers anywhere
            free = self.compute_free[rank]
            start = ready if ready > free else free
            end, gather_start = start + self.seconds[action.stage][action.kind], -1.0
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
        key = ((ACTIVATION_IN if kind == FORWARD else GRADIENT_IN) * self.table_size
               + target_stage * self.step.micro_batches + micro_batch)
        if target_rank == rank:
            self.publish(key, end)
            return
        link = 2 * rank + (target_rank > rank)  # one send link per rank and direction
        free = self.link_free[link]
        start = end if end > free else free
        arrives = self.link_free[link] = start + seconds
        if not self.async_p2p:  # a blocking send holds the sender until the receiver has it
            self.compute_free[rank] = max(self.compute_free[rank], arrives)
        self.events.append(_new_tuple(Event, (self.row + rank, "comm",
                                              SEND_ACTIVATION if kind == FORWARD else SEND_GRADIENT, start,
                                              arrives, target_stage, micro_batch, self.row + target_rank)))
        self.publish(key, arrives)

    def run(self) -> tuple[list[Event], list[float], list[float]]:
        """Replay every action; (events, compute free, collective free per rank)."""
        step, events, queue, orders, cursor = self.step, self.events, self.queue, self.orders, self.cursor
        stages, last_stage, publish, ship, row = step.stages, self.last_stage, self.publish, self.ship, self.row
        m, table, compute_free, offer = step.micro_batches, self.table_size, self.compute_free, self.offer
        sends = [t.send_activation for t in stages]
        gathering = [t.param_gather > 0 for t in stages]
        reducing = [t.grad_reduce > 0 for t in stages]
        exchanging = [t.cp_forward > 0 or t.cp_backward > 0 for t in stages]  # context parallel
        vocab = [t.vocab_forward > 0 or t.vocab_backward > 0 for t in stages]  # vocabulary parallel
        for rank in range(step.pp):
            offer(rank)
        done = 0
        while queue:
            start, rank, end, gather_start = heappop(queue)
            index = cursor[rank]
            action = orders[rank][index]
            kind, stage, micro_batch = action
            if gathering[stage]:
                times = stages[stage]
                if gather_start >= 0:
                    gather_end = gather_start + self.gather_before(action)
                    self.collective_free[rank] = gather_end
                    events.append(Event(row + rank, "comm", PARAM_GATHER, gather_start, gather_end, stage,
                                        micro_batch))
                if kind != BACKWARD_WEIGHT:
                    frees = times.reshard_after_forward if kind == FORWARD else times.reshard_after_backward
                    (self.gathered.discard if frees else self.gathered.add)(stage)
            compute_free[rank] = end
            cursor[rank] = index + 1
            done += 1
            events.append(_new_tuple(Event, (row + rank, "compute", kind, start, end, stage, micro_batch, -1)))
            if exchanging[stage] and kind != BACKWARD_WEIGHT:  # inside the pass; drawn at its start, one bar
                exchange = stages[stage].cp_forward if kind == FORWARD else stages[stage].cp_backward
                events.append(Event(row + rank, "cp", CONTEXT_EXCHANGE, start, start + exchange, stage, micro_batch))
            if vocab[stage] and kind != BACKWARD_WEIGHT:  # inside the pass; drawn at its end, one bar
                spent = stages[stage].vocab_forward if kind == FORWARD else stages[stage].vocab_backward
                events.append(Event(row + rank, "cp", VOCAB_COLLECTIVES, end - spent, end, stage, micro_batch))
            if kind == FORWARD:
                if stage < last_stage:
                    ship(rank, stage + 1, FORWARD, micro_batch, end, sends[stage])
                else:
                    publish(FORWARD_DONE * table + stage * m + micro_batch, end)
            elif kind == BACKWARD_INPUT:
                publish(INPUT_DONE * table + stage * m + micro_batch, end)
            if (kind == BACKWARD or kind == BACKWARD_INPUT) and stage > 0:
                ship(rank, stage - 1, BACKWARD, micro_batch, end, sends[stage - 1])
            if reducing[stage] and ((stages[stage].reduce_every_micro_batch and kind == self.weight_kind)
                                    or self.last_weight_action.get(stage) == index):
                self.reduce(rank, action, start, end)
            offer(rank)
        self.visits += done
        if done < self.total:
            stuck = [str(self.orders[r][self.cursor[r]]) for r in range(step.pp)
                     if self.cursor[r] < len(self.orders[r])]
            raise RuntimeError(f"schedule {step.schedule} deadlocks at {stuck}")
        return events, self.compute_free, self.collective_free

    def reduce(self, rank: int, action: Action, start: float, end: float) -> None:
        """The data-parallel gradient reduction after a weight-gradient action (module docstring of
        sim/engine.py), no earlier than the floors agreed with the other replicas."""
        times = self.step.stages[action.stage]
        if self.step.overlap_grad_reduce:
            buckets = max(1, times.buckets)  # ready one by one while this action runs
            reduce_start = max(self.collective_free[rank], start + (end - start) / buckets)
            reduce_end = max(reduce_start + times.grad_reduce, end + times.grad_reduce / buckets)
        else:  # after the backward, and the rank waits for it
            reduce_start = max(self.collective_free[rank], end)
            reduce_end = reduce_start + times.grad_reduce
        count = self.reduce_count.get((rank, action.stage), 0)
        self.reduce_count[rank, action.stage] = count + 1
        key = (rank, action.stage, count)
        floor = self.joint.get(key)
        if floor is not None:
            reduce_start = max(reduce_start, floor[0])
            reduce_end = max(reduce_end, floor[1], reduce_start + times.grad_reduce)
        self.reductions[key] = (reduce_start, reduce_end)
        if not self.step.overlap_grad_reduce:
            self.compute_free[rank] = reduce_end
        self.collective_free[rank] = reduce_end
        self.events.append(Event(self.row + rank, "comm", GRAD_REDUCE, reduce_start, reduce_end,
                                 action.stage, action.micro_batch if times.reduce_every_micro_batch else -1))
