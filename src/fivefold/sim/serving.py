"""`simulate --serve`: the request stream replayed step by step through the runtime's own scheduler.

Each replica runs a batching.Scheduler (continuous batching, chunked prefill, paged KV with preemption by
recompute) — the object `fivefold serve` runs — and a request goes to the replica `batching.pick_replica`
picks (fewest queued tokens). A step's time is the cost model's (cost/serving.ReplicaCost.step) for what the
scheduler put in it; the first step of a replica that had nothing to run also pays the engine's wake-up. As the runtime's Engine.step does, a replica schedules and submits steps until pp are in
flight (Scheduler(limits, pipeline_depth=pp) gives each about 1/pp of the requests); a submitted step enters
stage 0 when the one before it has left, so a replica starts a step every busiest-stage time. The scheduler
skips requests whose step has not come back (update not yet called). `--batch B` is a closed loop: each
finished request lets the next one in at once.

Discrete events in time order (a heap): arrivals and finished steps. No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Any

from fivefold.batching import Scheduler, pick_replica
from fivefold.cost.deployment import Replica, limits_with_blocks
from fivefold.errors import SpecError
from fivefold.spec.serve import BatchLimits
from fivefold.spec.workload import Workload

ARRIVAL, STEP_DONE = 1, 0  # at equal times: finish steps first, then admit


@dataclass
class RequestRecord:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    replica: int = -1
    first_token_s: float = math.nan
    finish_s: float = math.nan

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass
class StepRecord:
    """One step of one replica: when it ran, how full it was (what the picture and the trace show)."""

    replica: int
    start_s: float
    end_s: float
    stage_s: float
    requests: int
    tokens: int
    kv_blocks: int  # in use after scheduling
    queued: int  # waiting requests after scheduling
    preempted: int


@dataclass
class ServingSimResult:
    requests: list[RequestRecord]
    steps: list[StepRecord] = field(default_factory=list)
    replicas: int = 1
    kv_blocks: list[int] = field(default_factory=list)
    preemptions: int = 0
    title: str = ""

    @property
    def duration_s(self) -> float:
        return max((r.finish_s for r in self.requests), default=0.0) - min(
            (r.arrival_s for r in self.requests), default=0.0)

    def percentiles(self, name: str) -> dict[str, float]:
        values = sorted(getattr(r, name) for r in self.requests if (name != "tpot_s" or r.output_tokens > 1))
        if not values:
            return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}

        def at(q: float) -> float:
            return values[min(len(values) - 1, int(q * len(values)))]

        return {"mean": sum(values) / len(values), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}

    def to_dict(self) -> dict:
        output = sum(r.output_tokens for r in self.requests)
        duration = self.duration_s or math.inf
        return {"requests": len(self.requests), "duration_s": self.duration_s,
                "ttft_s": self.percentiles("ttft_s"), "tpot_s": self.percentiles("tpot_s"),
                "latency_s": self.percentiles("latency_s"), "output_tokens_per_s": output / duration,
                "requests_per_s": len(self.requests) / duration, "steps": len(self.steps),
                "preemptions": self.preemptions, "replicas": self.replicas}


def _step_cost(replica: Replica, step) -> tuple[float, float]:
    """(busiest-stage seconds, latency) of one scheduled step: decodes read their KV, prefill chunks attend."""
    decodes = kv = samples = 0
    chunks = []
    for start, count, sample in zip(step.starts, step.num_tokens, step.samples):
        if count == 1 and sample and start > 0:
            decodes += 1
            kv += start + 1
        else:
            chunks.append((start, count))
        samples += sample
    cost = replica.cost.step(step.total_tokens, decodes, kv, chunks, samples=samples)
    return cost.stage_s, cost.latency_s


def simulate_serving(replicas: list[Replica], limits: BatchLimits, workload: Workload, pp: int, seed: int = 0,
                     record_steps: bool = True) -> ServingSimResult:
    """Replay `workload.num_requests` requests (module docstring)."""
    stream = workload.requests(workload.num_requests, seed)
    schedulers = [Scheduler(limits_with_blocks(limits, r.kv_blocks), pipeline_depth=pp) for r in replicas]
    records = [RequestRecord(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in stream]
    capacity = min(s.limits.kv_tokens for s in schedulers)
    for record in records:  # refuse what can never fit before replaying anything
        if record.prompt_tokens + record.output_tokens > capacity:
            raise SpecError("--output-len", f"{record.prompt_tokens}+{record.output_tokens} tokens",
                            f"a request longer than the KV cache's {capacity} tokens per replica never runs; give "
                            "more --kv-memory / --kv-blocks, or shorter requests")
    result = ServingSimResult(records, replicas=len(replicas), kv_blocks=[r.kv_blocks for r in replicas])
    record_ids = [str(index) for index in range(len(records))]
    by_id = dict(zip(record_ids, records))
    events: list[tuple[float, int, int, Any]] = []  # (time, kind, tie-break, request index | replica | (r, step))
    counter = 0
    closed = workload.batch
    next_request = 0
    first_wave = len(records) if closed is None else min(closed, len(records))
    for index in range(first_wave):
        heappush(events, (records[index].arrival_s if closed is None else 0.0, ARRIVAL, index, index))
    next_request = first_wave
    counter = len(records)
    in_flight = [0] * len(replicas)
    stage_free = [0.0] * len(replicas)
    steps_out = result.steps

    def start_steps(r: int, now: float, woken: bool = False) -> None:
        """What the runtime's Engine.step does: schedule and submit until pp steps are in flight. A submitted
        step enters stage 0 when the step before it has left it. `woken`: the replica was idle, and its first
        step pays the engine's wake-up (cost/serving.ReplicaCost.wake_s)."""
        nonlocal counter
        scheduler = schedulers[r]
        while in_flight[r] < pp:
            step = scheduler.schedule()
            result.preemptions += len(step.preempted)
            if not step.request_ids:
                return
            stage, latency = _step_cost(replicas[r], step)
            if woken:
                wake = replicas[r].cost.wake_s
                stage, latency, woken = stage + wake, latency + wake, False
            start = max(now, stage_free[r])
            in_flight[r] += 1
            stage_free[r] = start + stage
            counter += 1
            heappush(events, (start + latency, STEP_DONE, counter, (r, step)))
            if record_steps:
                steps_out.append(StepRecord(r, start, start + latency, stage, len(step.request_ids),
                                            step.total_tokens, scheduler.pool.in_use, len(scheduler.waiting),
                                            len(step.preempted)))

    while events:
        now, kind, _, payload = heappop(events)
        if kind == ARRIVAL:
            index = payload
            r = pick_replica(schedulers)
            record = records[index]
            record.arrival_s = now
            record.replica = r
            idle = in_flight[r] == 0 and not schedulers[r].running and not schedulers[r].waiting
            schedulers[r].add(record_ids[index], record.prompt_tokens, record.output_tokens)
            start_steps(r, now, woken=idle)
        else:
            r, done = payload
            in_flight[r] -= 1
            for request_id, sampled, start in zip(done.request_ids, done.samples, done.starts):
                if sampled and start < by_id[request_id].prompt_tokens + 1:  # a prefill's end: maybe the first
                    record = by_id[request_id]
                    if record.first_token_s != record.first_token_s:  # NaN: the first token
                        record.first_token_s = now
            for request_id in schedulers[r].update(done):
                by_id[request_id].finish_s = now
                if closed is not None and next_request < len(records):
                    heappush(events, (now, ARRIVAL, next_request, next_request))
                    next_request += 1
            start_steps(r, now)
    unfinished = sum(1 for r in records if r.finish_s != r.finish_s)
    if unfinished:
        raise SpecError("--requests", len(records), f"{unfinished} requests never finished in the simulation")
    return result
