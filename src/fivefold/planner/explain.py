"""Why one plan beats another, in one sentence a person can check against the breakdowns."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fivefold.spec.units import GIB

if TYPE_CHECKING:
    from fivefold.planner.candidates import Candidate


FIELDS = ("dp", "tp", "pp", "cp", "ep", "micro_batch", "schedule", "zero", "recompute", "sequence_parallel",
          "vocab_parallel")
LABELS = {"micro_batch": "micro-batch", "sequence_parallel": "sequence parallel",
          "vocab_parallel": "vocabulary parallel"}

# What a smaller value of each step-time component means, in words.
EFFECTS = {
    "bubble": "shrinks the pipeline bubble",
    "tp_comm": "cuts tensor-parallel communication",
    "dp_comm": "exposes less data-parallel communication",
    "pp_comm": "spends less on pipeline transfers",
    "cp_comm": "cuts context-parallel communication",
    "ep_comm": "cuts expert all-to-all time",
    "recompute": "recomputes less",
    "compute": "runs its kernels more efficiently",
    "host_overhead": "waits less on kernel launches",
    "optimizer": "spends less in the optimizer step",
    "vocab_comm": "spends less on vocabulary-parallel collectives",
}


def _value(plan, name: str) -> str:
    value = getattr(plan, name)
    if name in ("sequence_parallel", "vocab_parallel"):
        return "on" if value else "off"
    if name == "schedule" and plan.virtual_stages > 1:
        return f"{value}(v{plan.virtual_stages})"
    return str(value)


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f} s"
    return f"{value * 1e3:.0f} ms" if value >= 0.01 else f"{value * 1e3:.2f} ms"


def _savings(a, b) -> list[str]:
    """The (at most two) step-time components where estimate `a` saves most over estimate `b`."""
    gains = sorted(((b.breakdown_s.get(k, 0.0) - a.breakdown_s.get(k, 0.0), k) for k in EFFECTS), reverse=True)
    reasons = []
    for saving, kind in gains[:2]:
        if saving <= 0.001 * b.step_time_s:
            break
        if kind == "bubble":
            detail = f"{b.bubble_fraction:.1%} -> {a.bubble_fraction:.1%} of the step"
        else:
            detail = f"{_seconds(b.breakdown_s[kind])} -> {_seconds(a.breakdown_s.get(kind, 0.0))} per step"
        reasons.append(f"{EFFECTS[kind]} ({detail})")
    return reasons


def explain_difference(best: Candidate, other: Candidate) -> str:
    """E.g. "pp=4 instead of pp=8: shrinks the pipeline bubble (12.0% -> 6.1% of the step) and costs 3.1 GiB
    more per GPU; 7.0% faster overall"."""
    a, b = best.estimate, other.estimate
    differs = [name for name in FIELDS if _value(best.plan, name) != _value(other.plan, name)]
    changes = " ".join(f"{LABELS.get(name, name)}={_value(best.plan, name)}" for name in differs)
    against = " ".join(f"{LABELS.get(name, name)}={_value(other.plan, name)}" for name in differs)
    subject = f"{changes} instead of {against}" if differs else "a different split of the layers"
    reasons = _vocab_reason(best, other) + _savings(a, b)
    memory = a.memory.total - b.memory.total
    if abs(memory) >= 0.05 * GIB:
        reasons.append(f"costs {memory / GIB:.1f} GiB more per GPU" if memory > 0
                       else f"saves {-memory / GIB:.1f} GiB per GPU")
    faster = b.step_time_s / a.step_time_s - 1
    if faster >= 0.0005:
        verdict = f"{faster:.1%} faster overall"
    elif faster > -0.0005:
        verdict = "as fast within 0.05%, and simpler"
    else:
        verdict = f"{-faster:.1%} slower but simpler (the planner asks 0.2% per extra moving part)"
    return f"{subject}: " + (" and ".join(reasons) + "; " if reasons else "") + verdict


def _vocab_reason(best: Candidate, other: Candidate) -> list[str]:
    """Why vocabulary parallelism wins: the LM head and loss dominate the last stage without it."""
    if not best.plan.vocab_parallel or other.plan.vocab_parallel or not other.estimate.stage_costs:
        return []
    stages = other.estimate.stage_costs
    work = [s.forward + s.backward_input + s.backward_weight for s in stages]
    middle = sorted(work)[len(work) // 2]
    if work[-1] <= middle:
        return []
    evened = max(s.forward + s.backward_input + s.backward_weight for s in best.estimate.stage_costs)
    return [f"the LM head and loss make the last stage {work[-1] / middle - 1:.0%} heavier than the median stage "
            f"({_seconds(work[-1])} vs {_seconds(middle)} per micro-batch); split over the pp ranks the busiest "
            f"stage takes {_seconds(evened)}"]


def explain_vocab_parallel(best: Candidate, without: Candidate) -> str:
    """Why the winner splits the vocabulary over the pp ranks, against `without`: the same plan without it
    (its layers balanced the planner's way), e.g. "vocabulary parallel: the LM head and loss make the last
    stage 52% heavier than the median stage (...); 23.1% faster than without it"."""
    reasons = _vocab_reason(best, without) or ["the LM head and loss are split over the pp ranks"]
    faster = without.estimate.step_time_s / best.estimate.step_time_s - 1
    return f"vocabulary parallel: {reasons[0]}; {faster:.1%} faster than without it"


def explain_empty_ends(best: Candidate) -> str:
    """Why a balanced split left an end stage without a layer: its embedding or head outweighs a layer. Empty
    when both ends hold layers."""
    plan, stages = best.plan, best.estimate.stage_costs
    work = [s.forward + s.backward_input + s.backward_weight for s in stages]
    full = [w / s.layers for w, s in zip(work, stages) if s.layers > 0]
    if not stages or not full or min(plan.layers_per_stage[0], plan.layers_per_stage[-1]) > 0:
        return ""
    per_layer = min(full)
    ends = [(name, w) for name, w, layers in (("embedding", work[0], plan.layers_per_stage[0]),
                                              ("LM head and loss", work[-1], plan.layers_per_stage[-1])) if layers == 0]
    return "; ".join(f"the {name} alone on the {'first' if name == 'embedding' else 'last'} stage ({_seconds(w)} per "
                     f"micro-batch, {w / per_layer:.1f} layers' worth)" for name, w in ends)


# --- mixed clusters ----------------------------------------------------------------------------------

def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def _groups_of(plan, ranks) -> set[int]:
    slots = plan.cluster.slots()
    return {slots[plan.placement[r]].group for r in ranks}


def holdings(plan) -> tuple[str, str]:
    """(kind, text): which cluster group holds which pipeline stages ("stages") or data-parallel replicas
    ("replicas"), e.g. "stages 0-1 (36 layers) on 2x8xA100-80GB, stages 2-3 (44 layers) on 2x8xH100-SXM"."""
    stage_groups = [_groups_of(plan, plan.pipeline_ranks(r)) for r in range(plan.pp)]
    replica_groups = [_groups_of(plan, plan.replica_ranks(d)) for d in range(plan.dp)]
    labels = [g.label for g in plan.cluster.groups]
    if len(set(labels)) < len(labels):  # e.g. two CPU groups that differ only in `speed`
        labels = [f"group {i} ({label})" for i, label in enumerate(labels)]
    parts = []
    if all(len(g) == 1 for g in replica_groups) and len(set().union(*replica_groups)) > 1 and (
            plan.pp == 1 or any(len(g) > 1 for g in stage_groups)):
        kind = "replicas"
        for group in sorted(set().union(*replica_groups), key=lambda g: min(
                d for d, gs in enumerate(replica_groups) if g in gs)):
            mine = [d for d, gs in enumerate(replica_groups) if gs == {group}]
            counts = sorted({plan.micro_batches_of_replica(d) for d in mine})
            share = (f"{counts[0]} micro-batch{'es' if counts[0] > 1 else ''}" + (" each" if len(mine) > 1 else "")
                     if len(counts) == 1 else "/".join(str(plan.micro_batches_of_replica(d)) for d in mine)
                     + " micro-batches")
            parts.append(f"replica{'s' if len(mine) > 1 else ''} {_ranges(mine)} ({share}) on {labels[group]}")
        return kind, ", ".join(parts)
    kind = "stages"
    word = "stage" if plan.virtual_stages == 1 else "pipeline rank"
    used = sorted(set().union(*stage_groups), key=lambda g: min(r for r, gs in enumerate(stage_groups) if g in gs))
    for group in used:
        mine = [r for r, gs in enumerate(stage_groups) if group in gs]
        layers = sum(plan.layers_per_stage[s] for r in mine for s in plan.stages_of(r))
        shared = any(len(stage_groups[r]) > 1 for r in mine)
        parts.append(f"{word}{'s' if len(mine) > 1 else ''} {_ranges(mine)} ({layers} layer{'s' if layers > 1 else ''})"
                     f" on {labels[group]}"
                     + (" (shared with another group)" if shared else ""))
    return kind, ", ".join(parts)


def cross_group_traffic(candidate: Candidate) -> tuple[float, float, float]:
    """Seconds per step of (pipeline sends, data-parallel communication, its exposed part) that cross
    between groups; the data-parallel ones count only when a replica group spans groups."""
    plan, estimate = candidate.plan, candidate.estimate
    slots = plan.cluster.slots()

    def group(rank: int) -> int:
        return slots[plan.placement[rank]].group

    sends = 0.0
    for stage in range(plan.num_stages - 1):
        a, b = plan.rank_of(pp=plan.stage_owner(stage)), plan.rank_of(pp=plan.stage_owner(stage + 1))
        if group(a) != group(b):  # forward activation and backward gradient, every micro-batch
            sends += 2 * estimate.micro_batches * estimate.stage_costs[stage].send_activation
    replicas = {group(r) for r in plan.group_ranks("dp", 0)}
    if len(replicas) > 1:
        return sends, estimate.dp_comm_s, estimate.dp_comm_exposed_s
    return sends, 0.0, 0.0


def _link(plan) -> str:
    bandwidth = plan.cluster.between_groups_bandwidth
    return f"the {bandwidth * 8 / 1e9:g} Gb/s link between the groups" if bandwidth else "the network between groups"


def _slower(other, best) -> str:
    ratio = other.estimate.step_time_s / best.estimate.step_time_s - 1
    if abs(ratio) < 0.0005:
        return "as fast (within 0.05%)"
    return f"{ratio:.1%} slower" if ratio > 0 else f"{-ratio:.1%} faster but not chosen (simpler plans win near-ties)"


def _rival_text(best, rival) -> str:
    """How a rival placement differs: its layout when the degrees differ."""
    if rival.plan.describe() == best.plan.describe():
        return f"is {_slower(rival, best)}"
    return f"(best such plan: {rival.plan.describe()}) is {_slower(rival, best)}"


def explain_placement(best: Candidate, others: list, even: Candidate) -> list[str]:
    """Lines for `fivefold plan` on a mixed cluster: which group holds which stages or replicas, why that
    placement (what crosses the slow link, against the best plan that places the other way) and how the
    work is balanced against the even split. `others`: (PlacementOption, Candidate) of rival placements."""
    kind, text = holdings(best.plan)
    lines = [f"placement: {text}"]
    sends, reduce, exposed = cross_group_traffic(best)
    rivals = [(c, holdings(c.plan)[0]) for _, c in others]
    other_kind = [c for c, k in rivals if k != kind]
    link = _link(best.plan)
    if other_kind:
        alt = min(other_kind, key=lambda c: c.estimate.step_time_s)
        alt_sends, alt_reduce, alt_exposed = cross_group_traffic(alt)
        if kind == "stages":
            lines.append(f"why: {link} carries only pipeline sends ({_seconds(sends)}/step) instead of the gradient "
                         f"reduction ({_seconds(alt_reduce)}/step, {_seconds(alt_exposed)} of it exposed) of whole "
                         f"replicas per group, which {_rival_text(best, alt)}")
        else:
            reasons = _savings(best.estimate, alt.estimate)
            lines.append(f"why: {link} carries the gradient reduction ({_seconds(reduce)}/step, {_seconds(exposed)} "
                         f"of it exposed) instead of pipeline sends ({_seconds(alt_sends)}/step) of whole stages "
                         f"per group, which {_rival_text(best, alt)}"
                         + (": replicas per group " + " and ".join(reasons) if reasons else ""))
    else:
        crossing = [f"{what} ({_seconds(seconds)}/step)" for what, seconds in
                    (("pipeline sends", sends), ("data-parallel traffic", reduce)) if seconds > 0]
        lines.append(f"why: {link} carries " + (" and ".join(crossing) if crossing else "no traffic of this plan"))
    same_kind = [c for c, k in rivals if k == kind and c.plan.placement != best.plan.placement]
    if same_kind:
        alt = min(same_kind, key=lambda c: c.estimate.step_time_s)
        lines.append(f"order: {holdings(alt.plan)[1]} {_rival_text(best, alt)}")
    plan = best.plan
    uneven_layers = plan.layers_per_stage != even.plan.layers_per_stage
    uneven_replicas = bool(plan.replica_micro_batches) and len(set(plan.replica_micro_batches)) > 1
    if uneven_layers or uneven_replicas:
        what = []
        if uneven_layers:
            what.append(f"layers per stage {'/'.join(map(str, plan.layers_per_stage))} instead of "
                        f"{'/'.join(map(str, even.plan.layers_per_stage))}")
        if uneven_replicas:
            what.append(f"micro-batches per replica {'/'.join(map(str, plan.replica_micro_batches))} instead of "
                        f"{'/'.join([str(even.plan.num_micro_batches)] * plan.dp)}")
        verdict = (f"the even split is {_slower(even, best)}" if even.estimate.fits else
                   f"the even split does not fit ({even.estimate.memory.total / GIB:.1f} GiB on pipeline rank "
                   f"{even.estimate.peak_pp_rank}, {even.estimate.capacity_bytes / GIB:.1f} GiB usable)")
        lines.append("balance: " + " and ".join(what) + ", by each device's speed and memory; " + verdict)
    return lines


def infeasible_message(smallest, headroom: float, choices) -> str:
    """Why nothing fits: how close the leanest plan came, and what to try."""
    if smallest is None:
        return "no candidate plan could be built"
    _, score, layout = smallest
    usable = score.peak_bytes / score.peak_ratio  # of the fullest rank's device, after the headroom
    capacity = usable / (1 - headroom)
    tries = []
    if choices.zero is not None and choices.zero < 3:
        tries.append("drop --zero (ZeRO-3 shards the weights too)")
    if choices.recompute is not None and choices.recompute != "full":
        tries.append("drop --recompute (full recompute keeps only layer inputs)")
    for dim in ("tp", "pp", "dp", "cp", "micro_batch"):
        if getattr(choices, dim) is not None:
            tries.append(f"drop --{dim.replace('_', '-')}")
    tries += ["more GPUs", "a shorter --seq-len", "a device with more memory"]
    if headroom > 0:
        tries.append(f"a smaller --headroom (now {headroom:g})")
    leanest = (f"dp{layout.dp} tp{layout.tp} pp{layout.pp}" + (f" cp{layout.cp}" if layout.cp > 1 else "")
               + f" mb{layout.micro_batch} {layout.schedule} zero{layout.zero} rc={layout.recompute}")
    return (f"no plan fits: the smallest plan ({leanest}) needs {score.peak_bytes / GIB:.1f} GiB per GPU on "
            f"pipeline stage {score.peak_pp_rank}; the device has {capacity / GIB:.1f} GiB"
            + (f" ({usable / GIB:.1f} GiB after {headroom:.0%} headroom)" if headroom else "")
            + "; try " + ", ".join(tries))
