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
PREEMPTIONS = 0.7  # preemptions per request at output = prompt with the KV cache binding (see _max_running)
KV_OCCUPANCY = 0.9  # requests running / what the blocks hold on average, when the cache binds (see _max_running)


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


def _decode_step(replica: Replica, per_step: float, prompt: float, output: float) -> StepCost:
    """A step of one in-flight batch of `per_step` decoding requests (mean context: prompt + half the output)."""
    decodes = max(1, round(per_step))
    return replica.cost.step(decodes, decodes, round(decodes * (prompt + output / 2)), samples=decodes)


def _prefill(replica: Replica, per_step: float, prompt: float, output: float, budget: int) -> tuple[float, float]:
    """(busy seconds a prompt's chunks add to each stage beside the decodes, its TTFT service: the chunks' step
    latencies one after another)."""
    decodes = max(1, round(per_step))
    kv = round(decodes * (prompt + output / 2))
    base = _decode_step(replica, per_step, prompt, output).stage_s
    room, total, start, extra, service = max(1, budget - decodes), max(1, round(prompt)), 0, 0.0, 0.0
    while start < total:
        chunk = min(room, total - start)
        step = replica.cost.step(decodes + chunk, decodes, kv, [(start, chunk)], samples=decodes + 1)
        extra += step.stage_s - base
        service += step.latency_s
        start += chunk
    return extra, service


def _tpot(replica: Replica, n: float, prompt: float, output: float, budget: int, pp: int,
          recompute: float = 1.0) -> tuple[float, StepCost]:
    """Mean time per output token with n requests running: the decode step's latency, stretched by the prefills
    that share the stages (one arrives per finished request: n / (output x TPOT) per second, each taking
    `extra` of every stage): TPOT = L / (1 - rate x extra) = L + n x extra / output. With pp stages the
    requests in the prefill's own step wait `extra` at every stage and the other groups once behind it: on
    average (pp + 1) / 2 times `extra`. `recompute`: prompts computed per request (1 + preemptions)."""
    step = _decode_step(replica, n / pp, prompt, output)
    extra, _ = _prefill(replica, n / pp, prompt, output, budget)
    return step.latency_s + recompute * n * extra * (pp + 1) / 2 / output, step


def _max_running(replica: Replica, limits: BatchLimits, prompt: float, output: float, pp: int,
                 no_evict: bool = False) -> tuple[float, float]:
    """(requests the scheduler keeps running at most: batch limit, KV blocks, token budget; prompts computed per
    request). fivefold's scheduler (vLLM's) admits on the first chunk's blocks, so the cache holds each request's
    prompt and half its output on average, and a full cache preempts the newest request, which computes its
    prompt again: PREEMPTIONS x (output / prompt) ** 0.85 times per request while the KV blocks bind, and the
    churn keeps KV_OCCUPANCY of the requests the blocks hold running (both fitted on sim/serving.py's replays of
    that scheduler, Llama 3 8B on one H100, output/prompt 1/4 to 4). `no_evict`: TensorRT-LLM's default
    GUARANTEED_NO_EVICT admission reserves the whole request (prompt + output) and never preempts."""
    block = limits.block_size
    held = math.ceil((prompt + (output if no_evict else output / 2)) / block) * block
    by_kv = replica.kv_blocks * block / held
    other = min(float(limits.max_batch), pp * limits.max_tokens_per_step)
    if no_evict or by_kv >= other:
        return max(1.0, other if by_kv >= other else by_kv), 1.0
    # The cache binds: preemption churn keeps KV_OCCUPANCY of that many running (fitted like PREEMPTIONS).
    return max(1.0, KV_OCCUPANCY * by_kv), 1.0 + PREEMPTIONS * (output / prompt) ** 0.85


def capacity_tokens_per_s(replica: Replica, limits: BatchLimits, prompt: float, output: float, pp: int,
                          no_evict: bool = False) -> float:
    """Output tokens/s of one replica at saturation."""
    top, recompute = _max_running(replica, limits, prompt, output, pp, no_evict)
    return top / _tpot(replica, top, prompt, output, limits.max_tokens_per_step, pp, recompute)[0]


def replica_state(replica: Replica, limits: BatchLimits, workload: Workload, running: float | None,
                  rate: float | None, pp: int, drain_requests: float, no_evict: bool = False) -> ReplicaState:
    """Steady state at `running` requests (inf / batch) or at `rate` requests/s (fixed point)."""
    prompt, output = workload.mean_prompt, workload.mean_output
    budget = limits.max_tokens_per_step
    top, full_recompute = _max_running(replica, limits, prompt, output, pp, no_evict)
    capacity = capacity_tokens_per_s(replica, limits, prompt, output, pp, no_evict)
    saturated = False
    if rate is not None and math.isfinite(rate):
        if rate * output >= SATURATION * capacity:
            saturated, n = True, top
        else:
            n = min(top, max(1.0, rate * output * _tpot(replica, 1, prompt, output, budget, pp)[0]))
            for _ in range(40):  # Little's law: n = rate x (TTFT + output x TPOT)
                tpot = _tpot(replica, n, prompt, output, budget, pp, full_recompute if n >= 0.95 * top else 1.0)[0]
                ttft = _prefill(replica, n / pp, prompt, output, budget)[1]
                n_new = min(top, max(rate * (ttft + output * tpot), 1e-3))
                if abs(n_new - n) < 1e-3 * n:
                    n = n_new
                    break
                n = 0.5 * (n + n_new)
    else:
        n = top if running is None else min(running, top)
    recompute = full_recompute if n >= 0.95 * top else 1.0
    tpot, step = _tpot(replica, n, prompt, output, budget, pp, recompute)
    tokens_per_s = n / tpot
    if rate is not None and math.isfinite(rate) and not saturated:
        tokens_per_s = rate * output
    service = _prefill(replica, n / pp, prompt, output, budget)[1]
    service_p90 = _prefill(replica, n / pp, workload.quantile_prompt(0.9), output, budget)[1]
    if rate is not None and math.isfinite(rate):
        rho = min(tokens_per_s / capacity, SATURATION)
        wait = math.inf if saturated else rho / (2 * (1 - rho)) * step.stage_s + step.stage_s / 2
        wait_p90 = wait * math.log(10)
    elif rate is not None:  # inf: all queued at once; admitted in waves of n as earlier ones finish
        # Request i waits for (i // n) waves before it, then for the prefill of the (i % n) admitted with it,
        # which share the token budget of each step.
        wave = service + output * tpot
        count, width = max(1, round(drain_requests)), max(1, int(n))
        admit = prompt / (budget * pp) * step.stage_s
        wait = sum((i // width) * wave + (i % width) * admit for i in range(count)) / count
        at90 = int(0.9 * count)
        wait_p90 = (at90 // width) * wave + (at90 % width) * admit
    else:
        wait = wait_p90 = step.stage_s / 2
    p90_running = min(top, n + Z90 * math.sqrt(n)) if rate is not None and math.isfinite(rate) else n
    tpot_p90 = _tpot(replica, p90_running, prompt, output, budget, pp, recompute)[0]
    return ReplicaState(n, top, 0.0, step, tpot, max(tpot_p90, tpot), wait + service,
                        wait_p90 + service_p90, tokens_per_s, capacity, saturated)


def estimate_serving(replicas: list[Replica], limits: BatchLimits, workload: Workload, pp: int,
                     frontend_s: float = 0.0, no_evict: bool = False) -> ServingEstimate:
    """The deployment's steady state (module docstring); `replicas` from cost/deployment.place. `frontend_s`: a
    serving frontend's own latency before the first token (HTTP, tokenizer), added to TTFT."""
    prompt, output = workload.mean_prompt, workload.mean_output
    capacities, known = [], {}
    for replica in replicas:
        key = (id(replica.cost), replica.kv_blocks)
        if key not in known:
            known[key] = capacity_tokens_per_s(replica, limits, prompt, output, pp, no_evict)
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
                                      workload.num_requests * share, no_evict)
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
