"""The engine (the launching process, rank 0 of the serving world): the requests' tokens, one batching Scheduler
per replica (batching/scheduler.py, the very one `simulate --serve` replays), the router, and sampling.

Each call of `step()` tops every replica up to pp steps in flight (so every pipeline stage has work during
decode), then takes the finished steps' logits from the executor, samples, and tells the scheduler."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fivefold.batching import Scheduler, Step, pick_replica
from fivefold.errors import SpecError
from fivefold.serve.batch import StepBatch
from fivefold.serve.sampling import SamplingParams, sample_rows
from fivefold.spec.serve import ServeLayout


def check_request(prompt_tokens: int, max_tokens: int, max_context: int, scheduler: Scheduler) -> None:
    """Refuse what could never run (SpecError naming the field): an empty prompt, max_tokens < 1, more than the
    model's context, or more than one replica's KV cache holds."""
    if max_tokens < 1:
        raise SpecError("max_tokens", max_tokens, "must be at least 1")
    if max_context and prompt_tokens + max_tokens > max_context:
        field_name, value = ("prompt", prompt_tokens) if prompt_tokens >= max_context else ("max_tokens", max_tokens)
        raise SpecError(field_name, value, f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                        f"the model's context of {max_context} tokens")
    scheduler.check_fits(prompt_tokens, max_tokens)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    stop_check: Callable[["Request"], bool] | None = None  # e.g. a stop string in the decoded text
    on_token: Callable[["Request", int], None] | None = None
    on_finish: Callable[["Request"], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    replica: int = 0
    arrival: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0

    @property
    def timings(self) -> dict:
        ttft = (self.first_token_at - self.arrival) if self.first_token_at is not None else None
        total = (self.finished_at - self.arrival) if self.finished_at is not None else None
        tpot = None
        if self.first_token_at is not None and self.finished_at is not None and len(self.output_ids) > 1:
            tpot = (self.finished_at - self.first_token_at) / (len(self.output_ids) - 1)
        return {"ttft_s": ttft, "tpot_s": tpot, "total_s": total}


class Engine:
    """Requests in, tokens out, over an executor that runs a StepBatch on a replica (executor.py)."""

    def __init__(self, executor, layout: ServeLayout, eos_ids: tuple[int, ...] = (), max_context: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.executor = executor
        self.layout = layout
        self.eos_ids = frozenset(eos_ids)
        self.max_context = max_context
        self.clock = clock
        self.schedulers = [Scheduler(layout.limits, layout.pp) for _ in range(layout.replicas)]
        self.most_in_flight = 0  # steps in flight at once on a replica, at most (pp when the pipeline is full)
        self.in_flight: list[deque[tuple[Step, StepBatch]]] = [deque() for _ in range(layout.replicas)]
        self.requests: dict[str, Request] = {}
        self.generated_tokens = 0
        self.preemptions = 0

    # -- requests ----------------------------------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        check_request(prompt_tokens, max_tokens, self.max_context, self.schedulers[0])

    def add(self, request: Request) -> None:
        self.check(len(request.prompt_ids), request.max_tokens)
        request.replica = pick_replica(self.schedulers)
        request.arrival = request.arrival or self.clock()
        self.schedulers[request.replica].add(request.request_id, len(request.prompt_ids), request.max_tokens)
        self.requests[request.request_id] = request

    def abort(self, request_id: str) -> None:
        """Drop a request (its client left): its KV blocks free now, or when its in-flight step comes back."""
        request = self.requests.get(request_id)
        if request is None:
            return
        request.finish_reason = "abort"
        self.schedulers[request.replica].abort(request_id)
        if request_id not in self.schedulers[request.replica].sequences:
            self._finish(request, "abort")

    # -- the loop ------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.requests) or any(self.in_flight)

    def step(self, wait: float = 0.05) -> bool:
        """Submit what can run, take back what finished (waiting up to `wait` s for it); True on any progress."""
        progress = False
        for replica, scheduler in enumerate(self.schedulers):
            while len(self.in_flight[replica]) < self.layout.pp:
                step = scheduler.schedule()
                self.preemptions += len(step.preempted)
                for request_id in step.preempted:
                    self.requests[request_id].preemptions += 1
                if not len(step):
                    break
                batch = self._batch(replica, step)
                self.in_flight[replica].append((step, batch))
                self.executor.submit(batch)
                self.most_in_flight = max(self.most_in_flight, len(self.in_flight[replica]))
                progress = True
        if any(self.in_flight):
            for replica, number, logits in self.executor.poll(wait):
                step, batch = self.in_flight[replica].popleft()
                assert step.number == number, (step.number, number)
                self._finish_step(replica, step, logits)
                progress = True
        return progress

    def _batch(self, replica: int, step: Step) -> StepBatch:
        scheduler = self.schedulers[replica]
        batch = StepBatch(step.number, replica, [], [], [], [], [], [])
        for request_id, start, count, sampled in zip(step.request_ids, step.starts, step.num_tokens, step.samples):
            request = self.requests[request_id]
            ids = request.prompt_ids + request.output_ids  # a preempted request recomputes its outputs too
            batch.token_ids += ids[start:start + count]
            batch.positions += range(start, start + count)
            batch.query_lens.append(count)
            batch.context_lens.append(start + count)
            batch.block_tables.append(list(scheduler.block_table(request_id)))
            if sampled:
                batch.sample_rows.append(len(batch.positions) - 1)
        return batch

    def _finish_step(self, replica: int, step: Step, logits) -> None:
        now = self.clock()
        stopped: set[str] = set()
        # The sampled rows in order; a request dropped since its step was submitted still has its row.
        rows = [self.requests.get(request_id) for request_id, sampled in zip(step.request_ids, step.samples)
                if sampled]
        params = [r.params if r is not None else SamplingParams() for r in rows]
        positions = [len(r.prompt_ids) + len(r.output_ids) if r is not None else 0 for r in rows]
        tokens = sample_rows(logits, params, positions).token_ids.tolist()  # the step's one copy to the host
        for request, token in zip(rows, tokens):
            if request is None or request.finish_reason == "abort":
                continue
            request_id = request.request_id
            request.output_ids.append(token)
            self.generated_tokens += 1
            if request.first_token_at is None:
                request.first_token_at = now
            if request.on_token is not None:
                request.on_token(request, token)
            if token in self.eos_ids or (request.stop_check is not None and request.stop_check(request)):
                stopped.add(request_id)
        for request_id in self.schedulers[replica].update(step, stopped):
            request = self.requests.get(request_id)
            if request is not None:
                reason = request.finish_reason or ("stop" if request_id in stopped else "length")
                self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.finished_at = self.clock()
        self.requests.pop(request.request_id, None)
        if request.on_finish is not None:
            request.on_finish(request)

    # -- what /metrics reads ----------------------------------------------------------------------------------
    @property
    def queued_requests(self) -> int:
        return sum(len(s.waiting) for s in self.schedulers)

    @property
    def running_requests(self) -> int:
        return sum(len(s.running) for s in self.schedulers)

    @property
    def kv_blocks_in_use(self) -> int:
        return sum(s.pool.in_use for s in self.schedulers)
