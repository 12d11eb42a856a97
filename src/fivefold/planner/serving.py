"""`plan --serve`: search tp x pp x replicas (x ep for MoE) and the scheduler's limits for a workload.

For each split (tp, pp, ep) the cluster is filled with as many replicas as fit, placed in the cluster's device
order (cost/deployment.place: a tp group stays in a node, a replica spanning two kinds of device runs at the
slower one's pace), and the steady state is estimated (cost/serving_estimate.py). Ranking:
- with latency targets: goodput per device — the highest request rate at which both p90 targets hold
  (DistServe's goodput, Zhong et al. 2024), found by bisection on the rate, over the devices used. With --rate
  as well, a split needs enough replicas to carry that rate at goodput; it uses no more replicas than that.
- without targets: output tokens/s per device at saturation (--rate inf), or with --batch B at B in flight.
The scheduler's limits (--max-batch and --max-tokens-per-step, the prefill chunk) are searched for the best
splits only: first every split with the defaults, then LIMIT_CHOICES for the REFINE_TOP best. The KV budget is
what memory leaves (or --kv-memory / --kv-blocks). Each choice given on the command line fixes it.
No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fivefold.cost.deployment import Replica, place
from fivefold.cost.serving_estimate import ServingEstimate, estimate_serving
from fivefold.errors import FivefoldError, SpecError
from fivefold.spec.checks import divisors
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.serve import BatchLimits, ServeLayout
from fivefold.spec.workload import Workload

LIMIT_CHOICES = [(64, 512), (128, 2048), (256, 2048), (256, 8192), (512, 8192)]  # (max batch, tokens per step)
REFINE_TOP = 4
BISECTION_STEPS = 14


@dataclass
class ServeCandidate:
    layout: ServeLayout
    estimate: ServingEstimate  # at the workload (the deployment of `layout.replicas` replicas)
    score: float  # goodput (requests/s) per device with targets, else output tokens/s per device
    meets: bool
    reason: str = ""  # why it misses the targets (empty when it meets them)
    goodput_rps: float = 0.0  # of the deployment as laid out

    def to_dict(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "replicas": lay.replicas, "ep": lay.ep, "devices": lay.devices,
                "max_batch": lay.limits.max_batch, "max_tokens_per_step": lay.limits.max_tokens_per_step,
                "dtype": lay.dtype, "kv_dtype": lay.kv_dtype, "meets_targets": self.meets,
                "score": self.score, "goodput_requests_per_s": self.goodput_rps, "reason": self.reason,
                **self.estimate.to_dict()}


class NoServingLayout(FivefoldError):
    """No split places the model on the cluster."""


def _splits(model: ModelSpec, world: int, fixed: dict) -> list[tuple[int, int, int]]:
    """(tp, pp, ep) that check_model accepts and fit the cluster."""
    out = []
    for tp in divisors(model.heads):
        if tp > world or fixed.get("tp") not in (None, tp):
            continue
        for pp in range(1, min(model.layers, world // tp) + 1):
            if fixed.get("pp") not in (None, pp) or (pp & (pp - 1) and (world // tp) % pp):
                continue  # powers of two, or an even share of the devices
            for ep in ((1, tp) if model.is_moe and tp > 1 else (1,)):
                if fixed.get("ep") not in (None, ep):
                    continue
                try:
                    ServeLayout(tp=tp, pp=pp, ep=ep).check_model(model)
                except SpecError:
                    continue
                out.append((tp, pp, ep))
    return out


def _max_meeting_rate(replicas: list[Replica], limits: BatchLimits, workload: Workload, pp: int,
                      capacity_rps: float) -> float:
    """Highest deployment rate whose estimate meets both p90 targets (0 if none does)."""
    def meets(rate: float) -> bool:
        return estimate_serving(replicas, limits, replace(workload, rate=rate, batch=None), pp).meets(workload)

    low, high = 0.0, capacity_rps
    if not meets(high * 1e-3):
        return 0.0
    low = high * 1e-3
    for _ in range(BISECTION_STEPS):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low


def _why_not(replicas: list[Replica], limits: BatchLimits, workload: Workload, pp: int) -> str:
    """What stops a split from meeting the targets even at a trickle of requests."""
    light = estimate_serving(replicas, limits, replace(workload, rate=1e-3, batch=None), pp)
    parts = []
    if workload.tpot_slo is not None and light.tpot_p90_s > workload.tpot_slo:
        parts.append(f"one request alone decodes at {light.tpot_p90_s * 1e3:.1f} ms/token "
                     f"(target {workload.tpot_slo * 1e3:g} ms)")
    if workload.ttft_slo is not None and light.ttft_p90_s > workload.ttft_slo:
        parts.append(f"the p90 prompt alone takes {light.ttft_p90_s:.3g} s to the first token "
                     f"(target {workload.ttft_slo:g} s)")
    return "; ".join(parts) or "the targets hold only at a rate below a request per 1000 s"


def _candidate(model: ModelSpec, cluster: ClusterSpec, layout: ServeLayout, workload: Workload,
               kv_blocks: int | None, kv_memory: float | None) -> ServeCandidate:
    if cluster.is_homogeneous and layout.replicas > 1 and workload.has_targets:
        # Identical replicas behind the router: goodput scales with their count, so one replica tells how
        # many the rate needs (and the goodput per device); the deployment is then estimated as a whole.
        one = _candidate(model, cluster, replace(layout, replicas=1), workload, kv_blocks, kv_memory)
        rate = workload.offered_rate
        if one.goodput_rps <= 0:
            return replace(one, layout=layout, estimate=estimate_serving(
                place(model, cluster, layout, kv_blocks, kv_memory), layout.limits, workload, layout.pp))
        needed = layout.replicas if rate is None or not math.isfinite(rate) else min(
            layout.replicas, max(1, math.ceil(rate / one.goodput_rps * (1 - 1e-9))))
        layout = replace(layout, replicas=needed)
        estimate = estimate_serving(place(model, cluster, layout, kv_blocks, kv_memory), layout.limits, workload,
                                    layout.pp)
        goodput = one.goodput_rps * needed
        meets = estimate.meets(workload) and (rate is None or goodput >= rate * (1 - 1e-6))
        reason = "" if meets else (f"meets the targets up to {goodput:.2f} requests/s on all {needed} replicas"
                                   if rate is not None else "misses the targets at this load")
        per_device = one.goodput_rps / (layout.tp * layout.pp)
        return ServeCandidate(layout, estimate, per_device if meets else 0.0, meets, reason, goodput)
    replicas = place(model, cluster, layout, kv_blocks, kv_memory)
    limits, pp = layout.limits, layout.pp
    saturated = estimate_serving(replicas, limits, replace(workload, rate=math.inf, batch=None), pp)
    capacity_rps = saturated.requests_per_s
    if not workload.has_targets:
        estimate = estimate_serving(replicas, limits, workload, pp) if (
            workload.rate is not None or workload.batch is not None or workload.trace) else saturated
        meets = not estimate.saturated
        basis = estimate if workload.batch is not None else saturated  # a closed loop: at its own batch
        return ServeCandidate(layout, estimate, basis.output_tokens_per_s / layout.devices, meets,
                              "" if meets else f"saturated: at most {capacity_rps:.2f} requests/s",
                              capacity_rps)
    goodput = _max_meeting_rate(replicas, limits, workload, pp, capacity_rps)
    rate = workload.offered_rate
    if goodput <= 0:
        estimate = estimate_serving(replicas, limits, workload, pp)
        return ServeCandidate(layout, estimate, 0.0, False, _why_not(replicas, limits, workload, pp), 0.0)
    if rate is not None and math.isfinite(rate):
        per_replica = goodput / layout.replicas
        needed = max(1, math.ceil(rate / per_replica * (1 - 1e-9)))
        if needed < layout.replicas:  # fewer replicas carry the rate: use only those
            layout = replace(layout, replicas=needed)
            return _candidate(model, cluster, layout, workload, kv_blocks, kv_memory)
        estimate = estimate_serving(replicas, limits, workload, pp)
        if goodput < rate * (1 - 1e-6):
            return ServeCandidate(layout, estimate, 0.0, False,
                                  f"meets the targets up to {goodput:.2f} requests/s on {layout.replicas} "
                                  f"replica(s); {rate:g} needs about {needed} replicas", goodput)
    else:
        estimate = estimate_serving(replicas, limits, workload, pp)
    meets = estimate.meets(workload)
    return ServeCandidate(layout, estimate, goodput / layout.devices if meets else 0.0, meets,
                          "" if meets else "misses the targets at this load", goodput)


def _rank(c: ServeCandidate) -> tuple:
    """Meeting the targets first, then the score; among those that miss, the highest goodput per device."""
    return (c.meets, c.score, c.goodput_rps / c.layout.devices)


def search_serving(model: ModelSpec, cluster: ClusterSpec, workload: Workload, dtype: str, kv_dtype: str,
                   fixed: dict, kv_blocks: int | None = None, kv_memory: float | None = None) -> list[ServeCandidate]:
    """Every split, best first (module docstring). `fixed`: tp/pp/ep/replicas/max_batch/max_tokens_per_step given."""
    world = cluster.world_size
    base = BatchLimits(max_batch=fixed.get("max_batch") or 256,
                       max_tokens_per_step=fixed.get("max_tokens_per_step") or 2048, kv_blocks=kv_blocks or 1024)
    found: list[ServeCandidate] = []
    failures: list[str] = []
    for tp, pp, ep in _splits(model, world, fixed):
        replicas = fixed.get("replicas") or world // (tp * pp)
        if replicas * tp * pp > world:
            continue
        layout = ServeLayout(tp=tp, pp=pp, replicas=replicas, ep=ep, dtype=dtype, kv_dtype=kv_dtype, limits=base)
        try:
            found.append(_candidate(model, cluster, layout, workload, kv_blocks, kv_memory))
        except SpecError as exc:
            failures.append(f"tp={tp} pp={pp}: {exc.fix}")
    if not found:
        raise NoServingLayout("no tp x pp split places " + model.name + " on " + cluster.label + (
            ": " + failures[-1] if failures else ""))
    found.sort(key=_rank, reverse=True)
    if not (fixed.get("max_batch") and fixed.get("max_tokens_per_step")):
        refined = []
        for best in found[:REFINE_TOP]:
            for max_batch, chunk in LIMIT_CHOICES:
                limits = BatchLimits(fixed.get("max_batch") or max_batch, fixed.get("max_tokens_per_step") or chunk,
                                     base.kv_blocks)
                if limits == best.layout.limits:
                    continue
                layout = replace(best.layout, replicas=fixed.get("replicas") or world // best.layout.tp //
                                 best.layout.pp, limits=limits)
                refined.append(_candidate(model, cluster, layout, workload, kv_blocks, kv_memory))
        found.extend(refined)
        found.sort(key=_rank, reverse=True)
    best_of_split: dict[tuple[int, int, int, int], ServeCandidate] = {}  # the best limits of each split
    for c in found:
        best_of_split.setdefault((c.layout.tp, c.layout.pp, c.layout.ep, c.layout.replicas), c)
    return list(best_of_split.values())
