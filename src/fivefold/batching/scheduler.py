"""The serving scheduler: plain data in, plain data out, no torch (as vLLM v1's scheduler).

Each call to `schedule()` returns one step: which requests run and with how many tokens. A request is a count of
tokens, never the tokens themselves: the runtime (serve/) keeps the ids and the model, the simulator (sim/ --serve)
keeps predicted times; both drive this same object, so what `simulate --serve` replays is what `serve` runs.

The rules (vLLM v1 / Orca / Sarathi-Serve):
- continuous batching: requests join and leave at every step;
- one token budget per step (`max_tokens_per_step`): running requests first, in the order they were admitted, each
  taking what it still needs (1 for a decode, the rest of its prompt for a prefill, cut to the budget: chunked
  prefill); then waiting requests, first come first served, while the budget, `max_batch` and free KV blocks allow;
- paged KV cache (batching/blocks.py): a request holds blocks for every token computed; admission needs blocks for
  the first chunk; when a running request needs a block and none is free, the most recently admitted running
  request is preempted by recompute: its blocks are freed and it goes back to the head of the queue, to compute
  its prompt and the tokens it already generated again (vLLM's RECOMPUTE preemption). No request is admitted in a
  step that preempted;
- pipeline parallel: a request in a step not yet finished (`update` not yet called) is "in flight" and skipped, so
  pp steps of disjoint requests can be in flight at once; with `pipeline_depth` = pp a step takes at most
  ceil(live requests / pp) of them, so the requests split into pp groups that keep every stage busy in decode.
Written by hand because it must run without a model or torch, fast enough to replay 10^4 requests in seconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from fivefold.batching.blocks import BlockPool
from fivefold.errors import SpecError
from fivefold.spec.serve import BatchLimits


class Sequence:
    """One request as the scheduler sees it: counts and a block table."""

    __slots__ = ("request_id", "prompt_tokens", "max_new_tokens", "output_tokens", "computed", "table",
                 "in_flight", "aborted", "preemptions")

    def __init__(self, request_id: str, prompt_tokens: int, max_new_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.output_tokens = 0  # tokens generated so far
        self.computed = 0  # tokens whose K/V are in the cache
        self.table: list[int] = []  # KV block ids, in token order
        self.in_flight = False
        self.aborted = False
        self.preemptions = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the cache must hold before the next token is sampled."""
        return self.prompt_tokens + self.output_tokens

    @property
    def queued_tokens(self) -> int:
        """Work left: tokens still to compute plus tokens still to generate."""
        return self.num_tokens - self.computed + self.max_new_tokens - self.output_tokens


@dataclass
class Step:
    """One forward pass over a batch: request i computes `num_tokens[i]` tokens from position `starts[i]`
    (their K/V go into its block table) and, when `samples[i]`, yields its next token."""

    number: int
    request_ids: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # requests sent back to the queue by this step

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.request_ids)


class Scheduler:
    """Continuous batching over one replica's paged KV cache."""

    def __init__(self, limits: BatchLimits, pipeline_depth: int = 1) -> None:
        self.limits = limits
        self.pipeline_depth = pipeline_depth
        self.pool = BlockPool(limits.kv_blocks, limits.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.sequences: dict[str, Sequence] = {}
        self.steps = 0
        self.preemptions = 0
        self.queued_tokens = 0  # sum of every sequence's queued_tokens, kept up to date (the router reads it often)

    # -- requests in and out ------------------------------------------------------------------------------
    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """A request that could never fit the cache alone would be preempted forever: refuse it up front."""
        if prompt_tokens < 1:
            raise SpecError("prompt", prompt_tokens, "must hold at least one token")
        if max_new_tokens < 1:
            raise SpecError("max_tokens", max_new_tokens, "must be at least 1")
        capacity = self.limits.kv_tokens
        if prompt_tokens + max_new_tokens > capacity:
            raise SpecError("max_tokens", max_new_tokens,
                            f"prompt ({prompt_tokens} tokens) + max_tokens exceeds the KV cache's {capacity} tokens; "
                            "ask for fewer tokens or serve with more --kv-blocks / --kv-memory")

    def add(self, request_id: str, prompt_tokens: int, max_new_tokens: int) -> None:
        if request_id in self.sequences:
            raise SpecError("request_id", request_id, "is already queued or running")
        self.check_fits(prompt_tokens, max_new_tokens)
        seq = Sequence(request_id, prompt_tokens, max_new_tokens)
        self.sequences[request_id] = seq
        self.waiting.append(seq)
        self.queued_tokens += seq.queued_tokens

    def abort(self, request_id: str) -> bool:
        """Drop a request (client gone); its blocks free now, or when its in-flight step ends. False if unknown."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return False
        if seq.in_flight:
            seq.aborted = True
            return True
        self._drop(seq)
        return True

    def _drop(self, seq: Sequence) -> None:
        self.queued_tokens -= seq.queued_tokens
        self.pool.release(seq.table)
        del self.sequences[seq.request_id]
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    # -- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> Step:
        """This step's batch; empty when nothing can run (all in flight, or nothing queued)."""
        step = Step(number=self.steps)
        self.steps += 1
        budget = self.limits.max_tokens_per_step
        cap = -(-len(self.sequences) // self.pipeline_depth)  # requests in this step at most
        index = taken = 0
        # The running loop is the simulator's hot path (10^4 requests, 10^5 steps): _take, num_tokens and the
        # block check are inlined here (same rules); the admission loop below uses them as written.
        running, block_size = self.running, self.pool.block_size
        ids, starts, counts, samples = step.request_ids, step.starts, step.num_tokens, step.samples
        while index < len(running) and budget > 0 and taken < cap:
            seq = running[index]
            if seq.in_flight:
                index += 1
                continue
            total, computed = seq.prompt_tokens + seq.output_tokens, seq.computed
            count = total - computed if total - computed < budget else budget
            if -(-(computed + count) // block_size) > len(seq.table) and not self._make_room(seq, count, index, step):
                continue  # seq itself was preempted; the list shifted onto the next one
            seq.in_flight = True
            ids.append(seq.request_id)
            starts.append(computed)
            counts.append(count)
            samples.append(computed + count == total)
            taken += 1
            budget -= count
            index += 1
        if step.preempted:
            return step
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_batch and len(step) < cap:
            seq = self.waiting[0]
            count = min(seq.num_tokens - seq.computed, budget)
            if not self.pool.grow(seq.table, seq.computed + count):
                break
            self.waiting.popleft()
            self.running.append(seq)
            self._take(step, seq, count)
            budget -= count
        return step

    def _make_room(self, seq: Sequence, count: int, index: int, step: Step) -> bool:
        """Blocks for `count` more tokens of running[index], preempting from the back; False if seq went."""
        while not self.pool.grow(seq.table, seq.computed + count):
            victim = next((other for other in reversed(self.running[index + 1:]) if not other.in_flight), seq)
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, step: Step) -> None:
        self.pool.release(seq.table)
        self.queued_tokens += seq.computed
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        step.preempted.append(seq.request_id)

    @staticmethod
    def _take(step: Step, seq: Sequence, count: int) -> None:
        seq.in_flight = True
        step.request_ids.append(seq.request_id)
        step.starts.append(seq.computed)
        step.num_tokens.append(count)
        step.samples.append(seq.computed + count == seq.num_tokens)

    def update(self, step: Step, stopped: Collection[str] = ()) -> list[str]:
        """Record that `step` ran; requests in `stopped` hit a stop condition the runtime saw (end of sequence,
        a stop string). Returns the requests that finished (or were aborted) with it, their blocks freed."""
        finished = []
        for request_id, count, sampled in zip(step.request_ids, step.num_tokens, step.samples):
            seq = self.sequences[request_id]
            seq.in_flight = False
            if seq.aborted:
                self._drop(seq)
                finished.append(request_id)
                continue
            seq.computed += count
            self.queued_tokens -= count
            if sampled:
                seq.output_tokens += 1
                if seq.output_tokens >= seq.max_new_tokens or request_id in stopped:
                    self._drop(seq)
                    finished.append(request_id)
        return finished

    # -- what the metrics and the router read --------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        return self.sequences[request_id].table

    @property
    def idle(self) -> bool:
        return not self.sequences


def pick_replica(schedulers: list[Scheduler]) -> int:
    """The router: the replica with the fewest queued tokens (the lowest index on a tie)."""
    return min(range(len(schedulers)), key=lambda index: schedulers[index].queued_tokens)
