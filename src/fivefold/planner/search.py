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
On a mixed cluster (planner/mixed.py) every schedule is also tried in each placement: whole stages per
group (layers in proportion to each stage's speed, capped by its memory) or whole replicas per group
(micro-batches in proportion to speed); the bound of step 2 then shares the work over every group's
speed. Every costed candidate uses cost.score_layout, the same code as `fivefold estimate`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable

from fivefold.cost.layout import Layout, layer_work, pacing_replica
from fivefold.cost.results import Score
from fivefold.cost.stack import DEFAULT_STACK, STACKS, SoftwareStack
from fivefold.cost.step import estimate, score_layout
from fivefold.errors import SpecError
from fivefold.planner.refusals import check_before_search
from fivefold.planner.candidates import Candidate, NoFeasiblePlan, SearchResult
from fivefold.planner.explain import infeasible_message
from fivefold.planner.found import _found, _Found
from fivefold.planner.mixed import (REPLICAS, STAGES, PlacementOption, fit_memory, is_mixed, placement_options,
                                    replica_shares, roomier, speed_balanced_layers, work_bound)
from fivefold.planner.space import (Choices, balanced_layers, check_stack_choices, cp_method_options, degree_options,
                                    etp_options, fixed_text, micro_batch_options, recompute_options, schedule_bound,
                                    schedule_options, sequence_parallel_option, useful_cp_methods,
                                    vocab_parallel_options, zero_options)
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import Plan, default_layers_per_stage, stage_owners
from fivefold.spec.train import TrainSpec


class _Context:
    """What every step of one search shares."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, choices: Choices,
                 stack: SoftwareStack, headroom: float, cost: Callable[..., Score],
                 threshold: Callable[[], float]) -> None:
        self.model, self.cluster, self.train, self.choices = model, cluster, train, choices
        self.stack, self.headroom, self.cost, self.threshold = stack, headroom, cost, threshold
        self.mixed = is_mixed(cluster)
        self.cp_method = "allgather"  # the context-parallel method of the degrees being searched
        self.etp, self.vocab_parallel = 1, False  # expert tensor parallel, vocabulary parallel being searched


def search(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, choices: Choices | None = None,
           headroom: float = 0.1, top: int = 5, stack: SoftwareStack | None = None,
           progress: Callable[[int, int, float], None] | None = None) -> SearchResult:
    """Rank the plans of `model` on `cluster` by predicted step time; only plans that fit are returned."""
    choices = choices or Choices()
    stack = stack or STACKS[DEFAULT_STACK]
    if not 0 <= headroom < 1:
        raise SpecError("--headroom", headroom, "must be a fraction in [0, 1), e.g. 0.1 keeps 10% free")
    if top < 1:
        raise SpecError("--top", top, "must be at least 1")
    started = time.perf_counter()
    check_stack_choices(stack, choices, train)
    check_before_search(model, cluster, train, choices)
    degrees = degree_options(model, cluster, train, choices, stack)
    if not degrees:
        raise SpecError("plan degrees", fixed_text(choices) or "(none fixed)",
                        f"no dp x tp x pp x cp split of the {cluster.world_size} devices is valid: tp must divide "
                        f"heads={model.heads} and kv_heads={model.kv_heads}, cp must divide seq_len={train.seq_len}, "
                        f"dp must divide global_batch={train.global_batch}")
    keep = max(top, 2)
    # max-heap by time (negated) of the `keep` fastest signatures; among equal times the one found first wins,
    # so the ranking does not depend on object addresses
    best: list[tuple[float, int, _Found]] = []
    found_order = itertools.count()
    examined = costed = 0
    smallest: tuple[float, Score, Layout] | None = None  # the plan closest to fitting
    last_report = started

    def threshold() -> float:
        return -best[0][0] if len(best) >= keep else float("inf")

    def cost(layout: Layout, timed: bool = True) -> Score:
        nonlocal costed, smallest
        costed += 1
        score = score_layout(layout, stack, headroom, time_if_overflowing=timed)
        if smallest is None or score.peak_ratio < smallest[0]:
            smallest = (score.peak_ratio, score, layout)
        return score

    ctx = _Context(model, cluster, train, choices, stack, headroom, cost, threshold)
    ordered = _order_by_bound(ctx, degrees)
    for done, ((dp, tp, pp, cp, ep), ctx.cp_method, ctx.etp) in enumerate(ordered):
        if progress is not None and time.perf_counter() - last_report > 0.25:
            last_report = time.perf_counter()
            progress(done, len(ordered), last_report - started)
        sequence_parallel = sequence_parallel_option(tp, choices)
        recomputes = recompute_options(stack, choices)
        zeros = zero_options(dp, cp, choices, stack=stack)
        options: list[PlacementOption | None] = [*placement_options(cluster, dp, tp, pp, cp)] if ctx.mixed else [None]
        for micro_batch in micro_batch_options(train, dp, choices, pp, stack):
            micro_batches = train.global_batch // (dp * micro_batch)
            schedules = schedule_options(model, pp, micro_batches, choices, stack)
            family = len(schedules) * len(recomputes) * len(zeros) * len(options)
            ctx.vocab_parallel = False
            base = _layout(ctx, (dp, tp, pp, cp, ep, micro_batch, "1f1b", 1), (1,) * pp, "none",
                           sequence_parallel, zeros[0])
            bound, sums = _family_bound(ctx, base, micro_batches)
            if bound >= threshold():
                examined += family
                continue
            vocab_options = vocab_parallel_options(pp, choices, stack, _head_share(ctx, base))
            examined += family * len(vocab_options)
            none_can_fit = True
            for (schedule, virtual), ctx.vocab_parallel in itertools.product(schedules, vocab_options):
                if schedule_bound(schedule, pp, virtual, micro_batches, sums) >= threshold():
                    none_can_fit = False  # not known; a bound is no reason to stop growing the micro-batch
                    continue
                signature = (dp, tp, pp, cp, ep, micro_batch, schedule, virtual)
                found, can_fit = _best_placement(ctx, signature, sequence_parallel, recomputes, zeros, options)
                none_can_fit = none_can_fit and not can_fit
                if found is not None:
                    heapq.heappush(best, (-found.key, -next(found_order), found))
                    if len(best) > keep:
                        heapq.heappop(best)
            if none_can_fit:
                break  # even the leanest variants do not fit; larger micro-batches need more memory
    if not best:
        raise NoFeasiblePlan(infeasible_message(smallest, headroom, choices))
    ranked = [entry[2] for entry in sorted(best, key=lambda entry: (entry[2].key, -entry[1]))]
    candidates = [Candidate(plan, estimate(plan, stack, headroom)) for plan in
                  (_plan(ctx, found) for found in ranked)]
    from fivefold.planner.diloco import best_diloco  # DiLoCo across the link between a cluster's groups
    from fivefold.planner.explain import explain_difference, explain_empty_ends, explain_placement, explain_vocab_parallel
    explanation = explain_difference(candidates[0], candidates[1]) if len(candidates) > 1 else "only one plan fits"
    ctx.cp_method, ctx.etp = ranked[0].cp_method, ranked[0].etp  # the alternatives keep the winner's
    if ranked[0].vocab_parallel and ctx.choices.vocab_parallel is None:
        explanation += "; " + explain_vocab_parallel(candidates[0], _without_vocab_parallel(ctx, ranked[0]))
    ctx.vocab_parallel, empty = ranked[0].vocab_parallel, explain_empty_ends(candidates[0])
    explanation += f"; {empty}" * bool(empty)
    placement = explain_placement(candidates[0], *_alternatives(ctx, ranked[0])) if ctx.mixed else []
    return SearchResult(candidates[:top], examined, costed, time.perf_counter() - started, explanation,
                        placement=placement, diloco=best_diloco(model, cluster, train, candidates[0].estimate.step_time_s,
                                                                stack, headroom, choices, search))


def _family_bound(ctx: _Context, base: Layout, micro_batches: int) -> tuple[float, list[float]]:
    """A lower bound on every plan of one (degrees, micro-batch), and the whole model's (F, B, W) of one
    micro-batch for the schedule bound: m micro-batches x (layers / pp) x one layer's forward + backward
    on one device type; on a mixed cluster, the work shared over every group's speed (mixed.work_bound)."""
    if ctx.mixed:
        return work_bound(base, ctx.stack, micro_batches)
    layer, embedding, head = layer_work(base, ctx.stack)
    per_layer = layer.forward + layer.backward_input + layer.backward_weight
    # All ranks together do F, B, W whatever the split; the slowest does at least 1/p of it.
    sums = [ctx.model.layers * getattr(layer, part) + getattr(embedding, part) + getattr(head, part)
            for part in ("forward", "backward_input", "backward_weight")]
    return micro_batches * ctx.model.layers / base.pp * per_layer, sums


def _without_vocab_parallel(ctx: _Context, found: _Found) -> Candidate:  # its layers split as then planned
    ctx.vocab_parallel = False
    split = _split(ctx, found.signature, found.sequence_parallel, found.recompute, found.option)
    plan = _plan(ctx, found, vocab_parallel=False, **({"layers_per_stage": split[0]} if split else {}))
    return Candidate(plan, estimate(plan, ctx.stack, ctx.headroom))


def _head_share(ctx: _Context, base: Layout) -> float:  # the LM head's work over one stage's layers' (one micro-batch)
    layer, _, head = layer_work(base, ctx.stack)
    return sum(head[:3]) * base.pp / (ctx.model.layers * sum(layer[:3]))


def _best_placement(ctx: _Context, signature: tuple, sequence_parallel: bool, recomputes: list[str],
                    zeros: list[int], options: list[PlacementOption | None]) -> tuple[_Found | None, bool]:
    """The best placement's fastest fitting variant of one (degrees, micro-batch, schedule), and whether
    any might fit; one device type has the one (identity) placement.

    Group orders of stages on groups differ mostly in memory (the first stage holds the most micro-batches
    in flight, the last the logits), so they are screened on the fastest variant and only the best goes
    on: the fastest that fits, else the one with the most memory to spare."""
    memo: dict[tuple, tuple[Score, Layout] | None] = {}
    winner: _Found | None = None
    any_can_fit = False

    def limit() -> float:
        return min(ctx.threshold(), winner.time if winner is not None else float("inf"))

    orders = [o for o in options if o is not None and o.kind == STAGES]
    if len(orders) > 1:
        keep: PlacementOption | None = orders[0]
        kept = _costed(ctx, memo, signature, sequence_parallel, recomputes[0], zeros[0], orders[0])
        if kept is not None and kept[0].step_time_s >= limit():
            keep = None  # the orders run the same compute: none can beat the limit
        for order in orders[1:] if keep is not None else ():
            result = _costed(ctx, memo, signature, sequence_parallel, recomputes[0], zeros[0], order)
            if result is not None and (kept is None or roomier(result[0], kept[0])):
                keep, kept = order, result
        options = [o for o in options if o not in orders or o == keep]
    for option in options:
        uneven = option is not None and option.kind == REPLICAS
        option_zeros = zero_options(signature[0], signature[3], ctx.choices, uneven_replicas=True,
                                    stack=ctx.stack) if uneven else zeros
        found, can_fit = _best_variant(ctx, memo, signature, sequence_parallel, recomputes, option_zeros, option,
                                       limit)
        any_can_fit = any_can_fit or can_fit
        if found is not None and (winner is None or found.key < winner.key):
            winner = found
    return winner, any_can_fit


def _costed(ctx: _Context, memo: dict, signature: tuple, sequence_parallel: bool, rc: str, zero: int,
            option: PlacementOption | None, timed: bool = True) -> tuple[Score, Layout] | None:
    """Score and layout of one variant in one placement with the balanced split (None: no valid split)."""
    key = (option, rc, zero, timed)
    if key not in memo:
        split_key = (option, rc)
        if split_key not in memo:
            memo[split_key] = _split(ctx, signature, sequence_parallel, rc, option)
        split = memo[split_key]
        layout = None if split is None else _layout(ctx, signature, split[0], rc, sequence_parallel, zero, option,
                                                    split[1])
        memo[key] = None if layout is None else (ctx.cost(layout, timed), layout)
    return memo[key]


def _best_variant(ctx: _Context, memo: dict, signature: tuple, sequence_parallel: bool, recomputes: list[str],
                  zeros: list[int], option: PlacementOption | None,
                  limit: Callable[[], float]) -> tuple[_Found | None, bool]:
    """The fastest fitting (recompute, zero) variant of one (degrees, micro-batch, schedule, placement), if
    it can beat the limit, and whether any variant might fit (False only when the leanest one is known
    not to). On a mixed cluster a variant that overflows memory also tries a split that moves layers
    off its fullest stages (_fit_memory) before the leaner variants are weighed against it."""
    variants = [(rc, zero) for rc in recomputes for zero in zeros]

    def costed(variant: tuple[str, int], timed: bool = True) -> tuple[Score, Layout] | None:
        return _costed(ctx, memo, signature, sequence_parallel, *variant, option, timed)

    fastest = costed(variants[0])
    if fastest is None:
        return None, False
    if fastest[0].step_time_s >= limit():
        return None, True  # every variant is at least this slow; whether one fits does not matter
    if fastest[0].fits:
        return _found(fastest[0], signature, variants[0], sequence_parallel, fastest[1], option), True
    fitting = []  # (score, variant, layout)
    refit = _fit_memory(ctx, *fastest)
    if refit[0].fits:
        fitting.append((refit[0], variants[0], refit[1]))
    if len(variants) > 1:
        leanest = costed(variants[-1], timed=False)  # past the fastest, only variants that fit need a time
        leanest = leanest and _fit_memory(ctx, *leanest)
        if leanest is not None and leanest[0].fits:
            fitting.append((leanest[0], variants[-1], leanest[1]))
            for variant in variants[1:-1]:
                result = costed(variant, timed=False)
                if result is not None and result[0].fits:
                    fitting.append((result[0], variant, result[1]))
    if not fitting:
        return None, False
    score, variant, layout = min(fitting, key=lambda entry: entry[0].step_time_s)
    return _found(score, signature, variant, sequence_parallel, layout, option), True


def _fit_memory(ctx: _Context, score: Score, layout: Layout) -> tuple[Score, Layout]:
    """mixed.fit_memory on a mixed cluster when the search picks the split (one device type: as is)."""
    if not ctx.mixed or ctx.choices.layers_per_stage is not None:
        return score, layout
    return fit_memory(score, layout, ctx.stack, ctx.cost)


def _split(ctx: _Context, signature: tuple, sequence_parallel: bool, rc: str,
           option: PlacementOption | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(layers per stage, micro-batches per replica): the user's layers, or balanced by cost; on a mixed
    cluster layers follow each stage's speed, and replicas on groups get micro-batches by speed."""
    dp, tp, pp, cp, ep, micro_batch, schedule, virtual = signature
    model, stages = ctx.model, pp * virtual
    replicas: tuple[int, ...] = ()
    if option is not None and option.kind == REPLICAS:
        probe = _layout(ctx, signature, (1,) * stages, rc, sequence_parallel, 0, option)
        shares = replica_shares(probe, ctx.stack, ctx.train.global_batch // (dp * micro_batch))
        if shares is None:
            return None
        replicas = shares
    fixed = ctx.choices.layers_per_stage
    if fixed is not None:
        return (fixed, replicas) if len(fixed) == stages else None
    if stages == 1:
        return (model.layers,), replicas
    if option is not None:
        probe = _layout(ctx, signature, (1,) * stages, rc, sequence_parallel, 0, option, replicas)
        split = speed_balanced_layers(probe, ctx.stack)
        return None if split is None else (split, replicas)
    probe = _layout(ctx, (dp, tp, pp, cp, ep, micro_batch, "1f1b", 1), (1,) * pp, rc, sequence_parallel, 0)
    layer, embedding, head = layer_work(probe, ctx.stack)
    per_layer = layer.forward + layer.backward_input + layer.backward_weight + layer.recompute
    first = (embedding.forward + embedding.backward_input + embedding.backward_weight) / per_layer
    last = (head.forward + head.backward_input + head.backward_weight) / per_layer
    if ctx.vocab_parallel:  # every rank runs its slice of both ends: they weigh on no stage in particular
        first = last = 0.0
    layers = balanced_layers(model.layers, stages, round(first, 2), round(last, 2), stage_owners(schedule, pp, virtual),
                             empty_ends=ctx.stack.features.empty_end_stages)
    return None if layers is None else (layers, replicas)


def _layout(ctx: _Context, signature: tuple, layers_per_stage: tuple[int, ...], recompute: str,
            sequence_parallel: bool, zero: int, option: PlacementOption | None = None,
            replicas: tuple[int, ...] = ()) -> Layout:
    dp, tp, pp, cp, ep, micro_batch, schedule, virtual = signature
    layout = Layout(model=ctx.model, cluster=ctx.cluster, train=ctx.train, dp=dp, tp=tp, pp=pp, cp=cp,
                    cp_method=ctx.cp_method, ep=ep, etp=ctx.etp, zero=zero, micro_batch=micro_batch,
                    schedule=schedule,
                    virtual_stages=virtual,
                    layers_per_stage=tuple(layers_per_stage), recompute=recompute,
                    sequence_parallel=sequence_parallel, placement=option.devices if option is not None else (),
                    num_micro_batches=ctx.train.global_batch // (dp * micro_batch), replica_micro_batches=replicas,
                    vocab_parallel=ctx.vocab_parallel)
    if replicas:
        layout.num_micro_batches = replicas[pacing_replica(layout)]  # as Layout.of_plan does
    return layout


def _plan(ctx: _Context, found: _Found, **changes: object) -> Plan:
    dp, tp, pp, cp, ep, micro_batch, schedule, virtual = found.signature
    fields = dict(dp=dp, tp=tp, pp=pp, cp=cp, cp_method=found.cp_method, ep=ep, etp=found.etp, zero=found.zero,
                  micro_batch=micro_batch, schedule=schedule,
                  virtual_stages=virtual, layers_per_stage=found.layers_per_stage, recompute=found.recompute,
                  sequence_parallel=found.sequence_parallel, vocab_parallel=found.vocab_parallel,
                  placement=found.option.devices if found.option is not None else (),
                  replica_micro_batches=found.replica_micro_batches)
    return Plan(model=ctx.model, cluster=ctx.cluster, train=ctx.train, **{**fields, **changes})


def _alternatives(ctx: _Context, found: _Found) -> tuple[list[tuple[PlacementOption, Candidate]], Candidate]:
    """For the explanation of a mixed-cluster plan: the best plan of the same degrees in every other
    placement, and of the other placement kind (stages or replicas on groups) with pipeline ranks traded
    for replicas or back (same tp and cp, when the user fixed neither dp nor pp); and the chosen plan with
    even layers and replicas."""
    dp, tp, pp, cp, ep, micro_batch, schedule, virtual = found.signature
    rivals = [found.signature]
    if ctx.choices.dp is None and ctx.choices.pp is None:
        for stages in (n for n in range(1, dp * pp + 1) if dp * pp % n == 0 and n != pp and n <= ctx.model.layers):
            replicas = dp * pp // stages
            sizes = [b for b in micro_batch_options(ctx.train, replicas, ctx.choices, stages, ctx.stack)
                     if b <= micro_batch]
            if not sizes:
                continue
            options = schedule_options(ctx.model, stages, ctx.train.global_batch // (replicas * sizes[-1]),
                                       ctx.choices, ctx.stack)
            if options:
                same = [o for o in options if o == (schedule, virtual)]
                rivals.append((replicas, tp, stages, cp, ep, sizes[-1], *(same or options)[0]))
    others = []
    kind = found.option.kind if found.option is not None else STAGES
    for signature in rivals:
        recomputes = recompute_options(ctx.stack, ctx.choices)
        for option in placement_options(ctx.cluster, *signature[:4]):
            if option == found.option and signature == found.signature or (
                    signature != found.signature and option.kind == kind):
                continue
            zeros = zero_options(signature[0], cp, ctx.choices, uneven_replicas=option.kind == REPLICAS,
                                 stack=ctx.stack)
            rival, _ = _best_variant(ctx, {}, signature, found.sequence_parallel, recomputes, zeros, option,
                                     lambda: float("inf"))
            if rival is not None:
                plan = _plan(ctx, rival)
                others.append((option, Candidate(plan, estimate(plan, ctx.stack, ctx.headroom))))
    layers = default_layers_per_stage(ctx.model.layers, pp * virtual)
    even = _plan(ctx, found, layers_per_stage=layers, replica_micro_batches=())
    return others, Candidate(even, estimate(even, ctx.stack, ctx.headroom))


def _order_by_bound(ctx: _Context, degrees: list[tuple[int, int, int, int, int]]
                    ) -> list[tuple[tuple[int, int, int, int, int], str, int]]:
    """(degrees, cp method, etp) sorted by the lower bound of their smallest micro-batch (promising layouts
    first); of the cp methods, those space.useful_cp_methods keeps; every etp that folds (space.etp_options)."""
    keyed = []
    for dp, tp, pp, cp, ep in degrees:
        micro_batches = micro_batch_options(ctx.train, dp, ctx.choices, pp, ctx.stack)
        if not micro_batches:
            continue
        micro_batch = micro_batches[0]
        for ctx.etp in etp_options(ctx.model, tp, cp, dp, ep, ctx.choices, ctx.stack):
            bounds = {}
            for ctx.cp_method in cp_method_options(ctx.model, tp, cp, ctx.choices, ctx.stack):
                probe = _layout(ctx, (dp, tp, pp, cp, ep, micro_batch, "1f1b", 1), (1,) * pp, "none",
                                sequence_parallel_option(tp, ctx.choices), 0)
                bounds[ctx.cp_method] = _family_bound(ctx, probe, ctx.train.global_batch // (dp * micro_batch))[0]
            for method in useful_cp_methods(ctx.model, ctx.cluster, ctx.train, (tp, pp, cp), micro_batch, bounds):
                keyed.append((bounds[method], (dp, tp, pp, cp, ep), method, ctx.etp))
    keyed.sort()
    return [(degrees, method, etp) for _, degrees, method, etp in keyed]
