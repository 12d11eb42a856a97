"""search(): enumerate every layout, prune what cannot win, cost the rest, rank the ones that fit.

Order of work, cheapest decisions first:
1. degrees (dp, tp, pp, cp, ep) that Plan.validate accepts, sorted by a lower bound on their step time
   so good plans are found early and the bound below prunes hard;
2. per degrees and micro-batch size, a lower bound: m micro-batches x (layers / pp) x one layer's
   forward + backward without recompute. Every plan of that family is at least this slow; when the
   bound is above the current N-th best, the whole family is skipped;
3. per schedule, the fastest variant (no recompute, lowest useful ZeRO level) is costed first. Its time
   bounds every other variant of the schedule (recompute and higher ZeRO levels only add time); if it
   fits it is the best of them, else the most memory-saving variant decides whether any can fit, and
   only then are the ones in between costed.
Layers are split over stages to balance stage time (the embedding and LM head count as extra layers).
Every costed candidate uses cost.estimate_layout, the same code as `fivefold estimate`.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable

from fivefold.cost.pipeline import bubble_ratio
from fivefold.cost.stack import STACKS, SoftwareStack
from fivefold.cost.layout import Layout, layer_work
from fivefold.cost.step import Estimate, Score, estimate, estimate_layout
from fivefold.errors import FivefoldError, SpecError
from fivefold.planner.space import (Choices, balanced_layers, degree_options, micro_batch_options,
                                    recompute_options, schedule_options, sequence_parallel_option, zero_options)
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import Plan
from fivefold.spec.train import TrainSpec

GIB = 2**30


class NoFeasiblePlan(FivefoldError):
    """No layout fits in device memory; the message says how close the best one came and what to try."""


@dataclass
class Candidate:
    """One ranked plan with its full estimate."""

    plan: Plan
    estimate: Estimate


@dataclass
class SearchResult:
    candidates: list[Candidate]  # fastest first; every one fits
    examined: int  # candidate plans considered (costed, or ruled out by a bound or dominance)
    costed: int  # of those, how many were costed in full
    seconds: float  # wall time of the search
    explanation: str = ""  # why the best beats the runner-up
    notes: list[str] = field(default_factory=list)

    @property
    def candidates_per_s(self) -> float:
        return self.examined / self.seconds if self.seconds > 0 else float("inf")


# Near-ties go to the simpler plan: each extra moving part (context or expert parallelism, a pipeline,
# interleaving, a ZeRO level, full recompute) must buy at least 0.2% of step time to rank higher.
SIMPLICITY_MARGIN = 0.002


@dataclass(order=True)
class _Found:
    key: float  # step time, scaled by the simplicity margin
    time: float = field(compare=False)
    signature: tuple = field(compare=False)  # (dp, tp, pp, cp, ep, micro_batch, schedule, virtual_stages)
    recompute: str = field(compare=False)
    zero: int = field(compare=False)
    sequence_parallel: bool = field(compare=False)
    layers_per_stage: tuple[int, ...] = field(compare=False)


def search(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, choices: Choices | None = None,
           headroom: float = 0.1, top: int = 5, stack: SoftwareStack | None = None,
           progress: Callable[[int, int, float], None] | None = None) -> SearchResult:
    """Rank the plans of `model` on `cluster` by predicted step time; only plans that fit are returned."""
    choices = choices or Choices()
    stack = stack or STACKS["modern"]
    if not 0 <= headroom < 1:
        raise SpecError("--headroom", headroom, "must be a fraction in [0, 1), e.g. 0.1 keeps 10% free")
    if top < 1:
        raise SpecError("--top", top, "must be at least 1")
    started = time.perf_counter()
    degrees = degree_options(model, cluster, train, choices)
    if not degrees:
        raise SpecError("plan degrees", _fixed_text(choices) or "(none fixed)",
                        f"no dp x tp x pp x cp split of the {cluster.world_size} devices is valid: tp must divide "
                        f"heads={model.heads} and kv_heads={model.kv_heads}, cp must divide seq_len={train.seq_len}, "
                        f"dp must divide global_batch={train.global_batch}")
    keep = max(top, 2)
    best: list[_Found] = []  # max-heap by time (negated) of the `keep` fastest signatures
    examined = costed = 0
    smallest: tuple[float, Score, Layout] | None = None  # the plan closest to fitting
    last_report = started

    def threshold() -> float:
        return -best[0][0] if len(best) >= keep else float("inf")

    def cost(layout: Layout) -> Score:
        nonlocal costed, smallest
        costed += 1
        score = estimate_layout(layout, stack, headroom, detail=False)
        if smallest is None or score.peak_ratio < smallest[0]:
            smallest = (score.peak_ratio, score, layout)
        return score

    ordered = _order_by_bound(model, cluster, train, degrees, choices, stack)
    for done, (dp, tp, pp, cp, ep) in enumerate(ordered):
        if progress is not None and time.perf_counter() - last_report > 0.25:
            last_report = time.perf_counter()
            progress(done, len(ordered), last_report - started)
        sequence_parallel = sequence_parallel_option(tp, choices)
        recomputes = recompute_options(stack, choices)
        zeros = zero_options(dp, cp, choices)
        for micro_batch in micro_batch_options(train, dp, choices):
            micro_batches = train.global_batch // (dp * micro_batch)
            schedules = schedule_options(model, pp, micro_batches, choices)
            family = len(schedules) * len(recomputes) * len(zeros)
            examined += family
            base = _layout(model, cluster, train, dp, tp, pp, cp, ep, micro_batch, "1f1b", 1, (1,) * pp,
                           "none", sequence_parallel, zeros[0])
            layer, embedding, head = layer_work(base, stack)
            per_layer = layer.forward + layer.backward_input + layer.backward_weight
            if micro_batches * model.layers / pp * per_layer >= threshold():
                continue
            # All ranks together do F, B, W whatever the split; the slowest does at least 1/p of it.
            sums = [model.layers * getattr(layer, part) + getattr(embedding, part) + getattr(head, part)
                    for part in ("forward", "backward_input", "backward_weight")]
            none_can_fit = True
            for schedule, virtual in schedules:
                if _schedule_bound(schedule, pp, virtual, micro_batches, sums) >= threshold():
                    none_can_fit = False  # not known; a bound is no reason to stop growing the micro-batch
                    continue
                found, can_fit = _best_variant(model, cluster, train, choices, stack, cost, threshold,
                                               (dp, tp, pp, cp, ep, micro_batch, schedule, virtual),
                                               sequence_parallel, recomputes, zeros)
                none_can_fit = none_can_fit and not can_fit
                if found is not None:
                    heapq.heappush(best, (-found.key, id(found), found))
                    if len(best) > keep:
                        heapq.heappop(best)
            if none_can_fit:
                break  # even the leanest variants do not fit; larger micro-batches need more memory
    seconds = time.perf_counter() - started
    if not best:
        raise NoFeasiblePlan(_infeasible_message(smallest, cluster, headroom, choices))
    ranked = sorted((entry[2] for entry in best), key=lambda f: f.key)
    candidates = [Candidate(plan, estimate(plan, stack, headroom)) for plan in
                  (_plan(model, cluster, train, found) for found in ranked)]
    from fivefold.planner.explain import explain_difference

    explanation = explain_difference(candidates[0], candidates[1]) if len(candidates) > 1 else \
        "only one plan fits"
    return SearchResult(candidates[:top], examined, costed, seconds, explanation)


def _schedule_bound(schedule: str, pp: int, virtual: int, micro_batches: int, sums: list[float]) -> float:
    """A lower bound on the pipeline time of any split: with total work S = sum_r w_r and a bubble that is
    f x (S - max_r w_r) (cost/pipeline.py), time = (m - f) max_r w_r + f S >= S ((m - f) / p + f), since
    max_r w_r >= S / p."""
    total = sum(sums)
    if pp == 1:
        return micro_batches * total
    factor = bubble_ratio(schedule, pp, 1, virtual, *sums) / bubble_ratio("1f1b", pp, 1)
    return total * ((micro_batches - factor) / pp + factor)


def _best_variant(model, cluster, train, choices, stack, cost, threshold, signature, sequence_parallel,
                  recomputes, zeros) -> tuple[_Found | None, bool]:
    """The fastest fitting (recompute, zero) variant of one (degrees, micro-batch, schedule), if it can beat
    the threshold, and whether any variant might fit (False only when the leanest one is known not to)."""
    dp, tp, pp, cp, ep, micro_batch, schedule, virtual = signature
    variants = [(rc, zero) for rc in recomputes for zero in zeros]
    layouts: dict[str, tuple[int, ...] | None] = {}

    def layout_for(rc: str, zero: int) -> Layout | None:
        if rc not in layouts:
            layouts[rc] = _split(model, cluster, train, choices, stack, signature, sequence_parallel, rc)
        split = layouts[rc]
        if split is None:
            return None
        return _layout(model, cluster, train, dp, tp, pp, cp, ep, micro_batch, schedule, virtual, split, rc,
                       sequence_parallel, zero)

    fastest = layout_for(*variants[0])
    if fastest is None:
        return None, False
    score = cost(fastest)
    if score.step_time_s >= threshold():
        return None, True  # every variant is at least this slow; whether one fits does not matter
    if score.fits:
        return _found(score, signature, variants[0], sequence_parallel, fastest), True
    if len(variants) == 1:
        return None, False
    leanest = layout_for(*variants[-1])
    lean_score = cost(leanest)
    if not lean_score.fits:
        return None, False
    winner = (lean_score, variants[-1], leanest)
    for variant in variants[1:-1]:
        layout = layout_for(*variant)
        score = cost(layout)
        if score.fits and score.step_time_s < winner[0].step_time_s:
            winner = (score, variant, layout)
    return _found(winner[0], signature, winner[1], sequence_parallel, winner[2]), True


def _found(score: Score, signature: tuple, variant: tuple[str, int], sequence_parallel: bool,
           layout: Layout) -> _Found:
    dp, tp, pp, cp, ep, micro_batch, schedule, virtual = signature
    parts = (cp > 1) + (ep > 1) + (pp > 1) + (virtual > 1) + variant[1] + (variant[0] == "full")
    return _Found(score.step_time_s * (1 + SIMPLICITY_MARGIN * parts), score.step_time_s, signature, variant[0],
                  variant[1], sequence_parallel, layout.layers_per_stage)


def _split(model, cluster, train, choices, stack, signature, sequence_parallel, rc) -> tuple[int, ...] | None:
    """Layers per stage: the user's, or balanced by cost."""
    dp, tp, pp, cp, ep, micro_batch, schedule, virtual = signature
    stages = pp * virtual
    if choices.layers_per_stage is not None:
        return choices.layers_per_stage if len(choices.layers_per_stage) == stages else None
    if stages == 1:
        return (model.layers,)
    probe = _layout(model, cluster, train, dp, tp, pp, cp, ep, micro_batch, "1f1b", 1, (1,) * pp, rc,
                    sequence_parallel, 0)
    layer, embedding, head = layer_work(probe, stack)
    per_layer = layer.forward + layer.backward_input + layer.backward_weight + layer.recompute
    first = (embedding.forward + embedding.backward_input + embedding.backward_weight) / per_layer
    last = (head.forward + head.backward_input + head.backward_weight) / per_layer
    owners = [probe_owner(schedule, pp, stage) for stage in range(stages)]
    return balanced_layers(model.layers, stages, round(first, 2), round(last, 2), owners)


def probe_owner(schedule: str, pp: int, stage: int) -> int:
    """Plan.stage_owner without a Plan: V-shaped for zbv, looped otherwise."""
    if schedule == "zbv":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def _layout(model, cluster, train, dp, tp, pp, cp, ep, micro_batch, schedule, virtual, layers_per_stage,
            recompute, sequence_parallel, zero) -> Layout:
    return Layout(model=model, cluster=cluster, train=train, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero,
                  micro_batch=micro_batch, schedule=schedule, virtual_stages=virtual,
                  layers_per_stage=tuple(layers_per_stage), recompute=recompute,
                  sequence_parallel=sequence_parallel, placement=(),
                  num_micro_batches=train.global_batch // (dp * micro_batch))


def _plan(model, cluster, train, found: _Found) -> Plan:
    dp, tp, pp, cp, ep, micro_batch, schedule, virtual = found.signature
    return Plan(model=model, cluster=cluster, train=train, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=found.zero,
                micro_batch=micro_batch, schedule=schedule, virtual_stages=virtual,
                layers_per_stage=found.layers_per_stage, recompute=found.recompute,
                sequence_parallel=found.sequence_parallel)


def _order_by_bound(model, cluster, train, degrees, choices, stack) -> list[tuple[int, int, int, int, int]]:
    """Degrees sorted by the lower bound of their smallest micro-batch (promising layouts first)."""
    keyed = []
    for dp, tp, pp, cp, ep in degrees:
        micro_batches = micro_batch_options(train, dp, choices)
        if not micro_batches:
            continue
        micro_batch = micro_batches[0]
        probe = _layout(model, cluster, train, dp, tp, pp, cp, ep, micro_batch, "1f1b", 1, (1,) * pp, "none",
                        sequence_parallel_option(tp, choices), 0)
        layer = layer_work(probe, stack)[0]
        per_layer = layer.forward + layer.backward_input + layer.backward_weight
        bound = train.global_batch // (dp * micro_batch) * model.layers / pp * per_layer
        keyed.append((bound, (dp, tp, pp, cp, ep)))
    keyed.sort()
    return [degrees for _, degrees in keyed]


def _fixed_text(choices: Choices) -> str:
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in vars(choices).items()
                    if value is not None)


def _infeasible_message(smallest, cluster: ClusterSpec, headroom: float, choices: Choices) -> str:
    if smallest is None:
        return "no candidate plan could be built"
    _, score, layout = smallest
    capacity = cluster.groups[0].device.memory_bytes
    usable = capacity * (1 - headroom)
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
