"""The steady state of a deployment under a workload: TTFT, TPOT, throughput, capacity (`estimate --serve`).

Per replica, with n requests running (split over the pp steps in flight, n / pp each), a step computes one token
per decoding request plus its share of prefill: in steady state every request that finishes decoding (after
`output` steps) is replaced by one whose prompt is prefilled in chunks, so a step carries n/pp x prompt/output
prefill tokens (Sarathi-Serve's chunked prefill, bounded by --max-tokens-per-step). A request's next token comes
one step latency later (all pp stages); a replica finishes n/pp tokens every busiest-stage time.

- `--rate inf`: n is as large as the scheduler lets it: --max-batch, the KV blocks (each request holds its prompt
  and half its output on average), and the token budget. The queue drains at that throughput.
- `--batch B`: n = B / replicas (a closed loop).
- `--rate R`: n follows from Little's law, n = R_r (TTFT + output x TPOT), solved by fixed-point iteration; the
  router (queued tokens) gives each replica a share of R proportional to its capacity. Above capacity the
  deployment is saturated (the queue and TTFT grow without bound).
- TTFT = waiting for admission + the prompt's chunks, one step latency each; the wait is an M/D/1 queue's at the
  replica's utilisation (rate) or half the drain time (inf). p90: the p90 prompt, the wait's exponential tail
  (x ln 10) and, for TPOT, the batch one Poisson standard deviation x 1.28 above its mean.
The simulator (sim/serving.py) replays the same scheduler step by step for the distributions themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fivefold.cost.deployment import Replica
from fivefold.cost.serving import StepCost
from fivefold.spec.serve import BatchLimits
from fivefold.spec.workload import Workload

Z90 = 1.2816  # standard normal 0.9-quantile
SATURATION = 0.98  # utilisation above which a finite rate counts as saturated


@dataclass
class ReplicaState:
    """One replica's steady state."""

    running: float  # requests running (all pp steps in flight together)
    max_running: float
    share: float  # of the deployment's requests
    stage: StepCost  # a typical step
    tpot_s: float
    tpot_p90_s: float
    ttft_s: float
    ttft_p90_s: float
    output_tokens_per_s: float
    capacity_tokens_per_s: float
    saturated: bool


@dataclass
class ServingEstimate:
    ttft_s: float
    ttft_p90_s: float
    tpot_s: float
    tpot_p90_s: float
    output_tokens_per_s: float
    requests_per_s: float
    kv_tokens: int  # per replica (the smallest), tokens the cache holds
    memory_gib: float  # busiest device
    devices: int
    saturated: bool
    replicas: list[ReplicaState] = field(default_factory=list)
    crossover_batch: float = 0.0

    def meets(self, workload: Workload) -> bool:
        return (not self.saturated
                and (workload.ttft_slo is None or self.ttft_p90_s <= workload.ttft_slo)
                and (workload.tpot_slo is None or self.tpot_p90_s <= workload.tpot_slo))

    def to_dict(self) -> dict:
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        first = self.replicas[0]
        return {"ttft_s": {"mean": finite(self.ttft_s), "p90": finite(self.ttft_p90_s)},
                "tpot_s": {"mean": self.tpot_s, "p90": self.tpot_p90_s},
                "output_tokens_per_s": self.output_tokens_per_s, "requests_per_s": self.requests_per_s,
                "kv_tokens": self.kv_tokens, "memory_gib": self.memory_gib, "devices": self.devices,
                "saturated": self.saturated, "running_per_replica": first.running,
                "max_running_per_replica": first.max_running, "crossover_batch": self.crossover_batch,
                "step": first.stage.to_dict()}


def _step(replica: Replica, per_step: float, prompt: float, output: float, budget: int) -> StepCost:
    """A typical step of one in-flight batch of `per_step` decoding requests and their share of prefill."""
    decodes = max(1, round(per_step))
    prefill = min(max(0.0, budget - decodes), per_step * prompt / output)
    chunk = max(0, round(prefill))
    context = prompt + output / 2
    chunks = [(max(0, round((prompt - chunk) / 2)), chunk)] if chunk else []
    return replica.cost.step(decodes + chunk, decodes, round(decodes * context), chunks, samples=decodes)


def _max_running(replica: Replica, limits: BatchLimits, prompt: float, output: float, pp: int) -> float:
    """Requests the scheduler keeps running at most: batch limit, KV blocks, token budget."""
    block = limits.block_size
    held = math.ceil((prompt + output / 2) / block) * block  # tokens a request holds on average
    by_kv = replica.kv_blocks * block / held
    by_budget = pp * limits.max_tokens_per_step / (1 + prompt / output)
    return max(1.0, min(float(limits.max_batch), by_kv, by_budget))


def _ttft_service(replica: Replica, per_step: float, prompt: float, output: float, budget: int) -> float:
    """Prefill of one prompt: its chunks, each one step latency, beside the running decodes."""
    room = max(1, budget - round(per_step))
    chunks = max(1, math.ceil(prompt / room))
    chunk = min(room, prompt)
    decodes = max(1, round(per_step))
    step = replica.cost.step(decodes + round(chunk), decodes, round(decodes * (prompt + output / 2)),
                             [(0, round(chunk))] * 1, samples=decodes + 1)
    return chunks * step.latency_s


def replica_state(replica: Replica, limits: BatchLimits, workload: Workload, running: float | None,
                  rate: float | None, pp: int, drain_requests: float) -> ReplicaState:
    """Steady state at `running` requests (inf / batch) or at `rate` requests/s (fixed point)."""
    prompt, output = workload.mean_prompt, workload.mean_output
    budget = limits.max_tokens_per_step
    top = _max_running(replica, limits, prompt, output, pp)
    full = _step(replica, top / pp, prompt, output, budget)
    capacity = (top / pp) / full.stage_s
    saturated = False
    if rate is not None and math.isfinite(rate):
        demand = rate * output
        if demand >= SATURATION * capacity:
            saturated, n = True, top
        else:
            n = min(top, max(1.0, rate * output * full.latency_s))
            for _ in range(40):  # Little's law: n = rate x (TTFT + output x TPOT)
                step = _step(replica, n / pp, prompt, output, budget)
                ttft = _ttft_service(replica, n / pp, prompt, output, budget)
                n_new = min(top, max(rate * (ttft + output * step.latency_s), 1e-3))
                if abs(n_new - n) < 1e-3 * n:
                    n = n_new
                    break
                n = 0.5 * (n + n_new)
    else:
        n = top if running is None else min(running, top)
    step = _step(replica, n / pp, prompt, output, budget)
    tokens_per_s = (n / pp) / step.stage_s if n >= pp else n / step.latency_s
    if rate is not None and math.isfinite(rate) and not saturated:
        tokens_per_s = rate * output
    service = _ttft_service(replica, n / pp, prompt, output, budget)
    service_p90 = _ttft_service(replica, n / pp, workload.quantile_prompt(0.9), output, budget)
    if rate is not None and math.isfinite(rate):
        rho = min(tokens_per_s / capacity, SATURATION)
        wait = math.inf if saturated else rho / (2 * (1 - rho)) * step.stage_s + step.stage_s / 2
        wait_p90 = wait * math.log(10)
    elif rate is not None:  # inf: all queued at once; admitted in waves of n as earlier ones finish
        # Request i waits for (i // n) waves before it, then for the prefill of the (i % n) admitted with it,
        # which share the token budget of each step.
        wave = service + output * step.latency_s
        count, width = max(1, round(drain_requests)), max(1, int(n))
        admit = prompt / (budget * pp) * step.stage_s
        wait = sum((i // width) * wave + (i % width) * admit for i in range(count)) / count
        at90 = int(0.9 * count)
        wait_p90 = (at90 // width) * wave + (at90 % width) * admit
    else:
        wait = wait_p90 = step.stage_s / 2
    p90_running = min(top, n + Z90 * math.sqrt(n)) if rate is not None and math.isfinite(rate) else n
    tpot_p90 = _step(replica, p90_running / pp, prompt, output, budget).latency_s
    return ReplicaState(n, top, 0.0, step, step.latency_s, max(tpot_p90, step.latency_s), wait + service,
                        wait_p90 + service_p90, tokens_per_s, capacity, saturated)


def estimate_serving(replicas: list[Replica], limits: BatchLimits, workload: Workload, pp: int,
                     frontend_s: float = 0.0) -> ServingEstimate:
    """The deployment's steady state (module docstring); `replicas` from cost/deployment.place. `frontend_s`: a
    serving frontend's own latency before the first token (HTTP, tokenizer), added to TTFT."""
    prompt, output = workload.mean_prompt, workload.mean_output
    capacities, known = [], {}
    for replica in replicas:
        key = (id(replica.cost), replica.kv_blocks)
        if key not in known:
            top = _max_running(replica, limits, prompt, output, pp)
            known[key] = (top / pp) / _step(replica, top / pp, prompt, output, limits.max_tokens_per_step).stage_s
        capacities.append(known[key])
    total = sum(capacities)
    rate = workload.offered_rate
    states = []
    seen: dict[tuple[int, int], ReplicaState] = {}  # identical replicas (same cost model and cache) once
    for replica, capacity in zip(replicas, capacities):
        share = capacity / total
        key = (id(replica.cost), replica.kv_blocks)
        if key not in seen:
            running = workload.batch * share if workload.batch is not None else None
            replica_rate = rate * share if rate is not None else None
            seen[key] = replica_state(replica, limits, workload, running, replica_rate, pp,
                                      workload.num_requests * share)
            seen[key].share = share
        states.append(seen[key])
    tokens = sum(s.output_tokens_per_s for s in states)

    def weighted(values: list[float]) -> float:
        return sum(v * s.share for v, s in zip(values, states))

    return ServingEstimate(
        ttft_s=weighted([s.ttft_s for s in states]) + frontend_s,
        ttft_p90_s=max(s.ttft_p90_s for s in states) + frontend_s,
        tpot_s=weighted([s.tpot_s for s in states]), tpot_p90_s=max(s.tpot_p90_s for s in states),
        output_tokens_per_s=tokens, requests_per_s=tokens / output,
        kv_tokens=min(r.kv_blocks for r in replicas) * limits.block_size,
        memory_gib=max(r.memory_bytes for r in replicas) / 2**30,
        devices=sum(len(r.devices) * len(r.devices[0]) for r in replicas),
        saturated=any(s.saturated for s in states), replicas=states,
        crossover_batch=replicas[0].cost.crossover_batch)
