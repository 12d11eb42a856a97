"""The search space: which degrees, micro-batches, schedules, recompute and ZeRO levels a plan may use.

Every option listed here is valid for Plan.validate; options that can never win are left out up front
(dominated): sequence parallelism is always on with tp > 1 (same communication volume, less memory and
element-wise work), ZeRO-0 loses to ZeRO-1 whenever there is more than one replica (same traffic, less
memory, shorter optimizer step), GPipe loses to 1F1B (same time, more memory) and selective recompute
equals no recompute when attention is fused (FlashAttention already recomputes the scores). A choice the
user fixes is always kept, dominated or not. Nothing the software stack cannot run is listed
(`SoftwareStack.features`): `check_stack_choices` turns a fixed choice outside it into an error.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

from fivefold.cost.compute import dtype_bytes
from fivefold.cost.context import context_parallel_kept_bytes
from fivefold.cost.pipeline import bubble_ratio
from fivefold.cost.stack import DEFAULT_STACK, STACKS, SoftwareStack
from fivefold.errors import SpecError
from fivefold.spec.checks import check_count
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import divisors
from fivefold.spec.train import TrainSpec

MAX_VIRTUAL_STAGES = 8  # interleaving beyond this gains little bubble and costs many more p2p hops


@dataclass(frozen=True)
class Choices:
    """What the user fixed; None means "search over it"."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None  # expert tensor parallel (MoE parallel folding); the search tries 1 and tp
    micro_batch: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    vocab_parallel: bool | None = None  # embedding, head and loss over the pp ranks (cost/vocab.py)
    zero: int | None = None
    layers_per_stage: tuple[int, ...] | None = None
    cp_method: str | None = None

    def __post_init__(self) -> None:
        # A fixed choice of 0 or less is a mistake, never "search over it" (that is None).
        for name in ("dp", "tp", "pp", "cp", "ep", "etp", "micro_batch", "virtual_stages"):
            value = getattr(self, name)
            if value is not None:
                check_count(value, f"--{name.replace('_', '-')}")
        if self.zero is not None:
            check_count(self.zero, "--zero", minimum=0, limit=3)


def _allowed(value: int, fixed: int | None) -> bool:
    return fixed is None or value == fixed


def check_stack_choices(stack: SoftwareStack, choices: Choices, train: TrainSpec) -> None:
    """A fixed choice the stack cannot run is an error that names what the stack can run."""
    features = stack.features
    can = f"{stack.name} runs: {features.describe()}"
    for dim in ("tp", "pp", "cp", "ep"):
        value = getattr(choices, dim)
        if value is not None and value > 1 and dim not in features.parallelisms:
            raise SpecError(f"--{dim}", value, f"the {stack.name} stack has no {dim} parallelism; {can}")
    if choices.cp_method is not None and choices.cp_method not in features.cp_methods:
        raise SpecError("--cp-method", choices.cp_method, f"not in the {stack.name} stack; {can}")
    if choices.schedule is not None and choices.schedule not in features.schedules:
        raise SpecError("--schedule", choices.schedule, f"not in the {stack.name} stack; {can}")
    if choices.zero is not None and choices.zero not in features.zero_levels:
        raise SpecError("--zero", choices.zero, f"not in the {stack.name} stack; {can}")
    if choices.recompute is not None and choices.recompute not in features.recompute:
        raise SpecError("--recompute", choices.recompute, f"not in the {stack.name} stack; {can}")
    if train.dtype == "fp8" and not features.fp8:
        raise SpecError("--dtype", "fp8", f"the {stack.name} stack has no FP8 training; {can}")
    if choices.vocab_parallel and not features.vocab_parallel:
        raise SpecError("--vocab-parallel", True, f"the {stack.name} stack has no vocabulary parallelism; {can}")


# Vocabulary parallelism is searched only where the LM head (GEMM and loss, one micro-batch) is at least this
# share of one stage's layer work: it can gain at most the head's share of the last stage, and below a
# quarter of a stage the collectives it adds over the pp group eat most of that (cost/vocab.py).
VOCAB_PARALLEL_HEAD_SHARE = 0.25


def vocab_parallel_options(pp: int, choices: Choices, stack: SoftwareStack, head_share: float) -> list[bool]:
    """Whether to try vocabulary parallelism for one (degrees, micro-batch): as fixed, else off, and also on
    when the stack runs it and the head is `head_share` >= VOCAB_PARALLEL_HEAD_SHARE of a stage's layers."""
    if pp <= 1:
        return [False]
    if choices.vocab_parallel is not None:
        return [choices.vocab_parallel]
    return [False, True] if stack.features.vocab_parallel and head_share >= VOCAB_PARALLEL_HEAD_SHARE else [False]


def degree_options(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                   choices: Choices, stack: SoftwareStack | None = None) -> list[tuple[int, int, int, int, int]]:
    """Every (dp, tp, pp, cp, ep) whose product is the world size, that Plan.validate accepts and that the
    stack can run."""
    world = cluster.world_size
    can = (stack or STACKS[DEFAULT_STACK]).features.parallelisms
    max_tp, max_pp, max_cp = (world if dim in can else 1 for dim in ("tp", "pp", "cp"))
    mlp_width = model.expert_ffn_hidden if model.is_moe else model.ffn_hidden
    out = []
    for tp in divisors(world):
        if tp > max_tp or not _allowed(tp, choices.tp) or model.heads % tp or model.kv_heads % tp or mlp_width % tp:
            continue
        for pp in divisors(world // tp):
            if pp > max_pp or not _allowed(pp, choices.pp) or pp > model.layers:
                continue
            for cp in divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                if cp > max_cp or not _allowed(cp, choices.cp) or not _allowed(dp, choices.dp):
                    continue
                if cp > 1 and train.seq_len % (2 * cp):  # context parallel cuts the sequence in 2*cp chunks
                    continue
                if train.global_batch % dp:
                    continue
                if model.is_moe and "ep" in can:  # folding: ep over tp x cp x dp (spanning tp), else dp x cp
                    folds = stack is not None and stack.features.moe_folding or stack is None
                    experts_options = [ep for ep in divisors(dp * cp * tp if folds else dp * cp)
                                       if model.experts % ep == 0 and etp_options(model, tp, cp, dp, ep, choices,
                                                                                   stack)]
                else:
                    experts_options = [1]
                for ep in experts_options:
                    if _allowed(ep, choices.ep):
                        out.append((dp, tp, pp, cp, ep))
    return out


def etp_options(model: ModelSpec, tp: int, cp: int, dp: int, ep: int, choices: Choices,
                stack: SoftwareStack | None = None) -> list[int]:
    """Expert tensor-parallel degrees for these degrees: the fixed --etp, else 1 (whole experts, ep may span tp)
    and tp (Megatron-Core's default: experts split like the MLP), those that fold (ep x etp divides
    tp x cp x dp, etp divides the expert width). A stack without folding runs etp 1 only."""
    if not model.is_moe:
        return [1]
    folds = stack is None or stack.features.moe_folding
    wanted = [choices.etp] if choices.etp is not None else sorted({1, tp}) if folds else [1]
    return [etp for etp in wanted if (tp * cp * dp) % (ep * etp) == 0 and model.expert_ffn_hidden % etp == 0
            and (folds or etp == 1)]


def micro_batch_options(train: TrainSpec, dp: int, choices: Choices, pp: int = 1,
                        stack: SoftwareStack | None = None) -> list[int]:
    """Sequences per micro-batch, smallest first (memory grows with it). A stack without gradient
    accumulation runs a replica's whole batch as one micro-batch unless a pipeline splits it."""
    per_replica = train.global_batch // dp
    if pp == 1 and stack is not None and not stack.features.gradient_accumulation:
        return [per_replica] if _allowed(per_replica, choices.micro_batch) else []
    return [b for b in divisors(per_replica) if _allowed(b, choices.micro_batch)]


def schedule_options(model: ModelSpec, pp: int, micro_batches: int, choices: Choices,
                     stack: SoftwareStack | None = None) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs valid for this pipeline and run by the stack."""
    if pp == 1:
        schedule = choices.schedule or "1f1b"
        virtual = choices.virtual_stages or (2 if schedule in ("zbv", "interleaved-1f1b") else 1)
        return [(schedule, virtual)]
    else:
        options = [("1f1b", 1), ("zb-h1", 1)]
        if micro_batches % pp == 0:
            top = min(MAX_VIRTUAL_STAGES, model.layers // pp)
            if choices.virtual_stages is not None:
                top = max(top, choices.virtual_stages)
            options += [("interleaved-1f1b", v) for v in range(2, top + 1) if pp * v <= model.layers]
        if model.layers >= 2 * pp:
            options.append(("zbv", 2))
        if choices.schedule == "gpipe":
            options.append(("gpipe", 1))
    runs = (stack or STACKS[DEFAULT_STACK]).features.schedules
    return [(s, v) for s, v in options if (choices.schedule is None or s == choices.schedule)
            and _allowed(v, choices.virtual_stages) and s in runs]


def recompute_options(stack: SoftwareStack, choices: Choices) -> list[str]:
    """Cheapest first: none, (selective), full."""
    if choices.recompute is not None:
        return [choices.recompute]
    kinds = ["none", "full"] if stack.attention == "flash" else ["none", "selective", "full"]
    return [kind for kind in kinds if kind in stack.features.recompute]


def zero_options(dp: int, cp: int, choices: Choices, uneven_replicas: bool = False,
                 stack: SoftwareStack | None = None) -> list[int]:
    """Fastest first; with one replica every level is the same plan, so only 0. With uneven micro-batches
    per replica (replicas on the groups of a mixed cluster), ZeRO-0 first and ZeRO-1 only to save memory:
    a ZeRO parameter all-gather is a collective every replica joins at the same point of its step (ZeRO-1
    and 2 at the first forward, ZeRO-3 at every pass), so a fast replica would wait for the slow one's
    forward there, which the even-split time of the cost model does not see (measured: bench/hetero.py)."""
    if choices.zero is not None:
        return [choices.zero]
    if dp * cp == 1:
        return [0]
    levels = (stack or STACKS[DEFAULT_STACK]).features.zero_levels
    wanted = [0, 1] if uneven_replicas else [1, 2, 3]
    kept = [zero for zero in wanted if zero in levels]
    # A stack without ZeRO-1 (TorchTitan: DDP or FSDP2) keeps its plain data parallelism as the fast option.
    if 1 not in kept and 0 in levels and 0 not in kept:
        kept.insert(0, 0)
    return kept


def sequence_parallel_option(tp: int, choices: Choices) -> bool:
    if choices.sequence_parallel is not None:
        return choices.sequence_parallel and tp > 1
    return tp > 1


def balanced_layers(layers: int, stages: int, first_extra: float, last_extra: float,
                    owners: list[int] | tuple[int, ...] | None = None,
                    layer_time: list[float] | tuple[float, ...] | None = None,
                    max_layers: list[int] | tuple[int, ...] | None = None,
                    empty_ends: bool = False) -> tuple[int, ...] | None:
    """Split `layers` over `stages` so the busiest pipeline rank is as little busy as possible.

    The first stage also runs the embedding and the last the LM head; their cost is given in the units
    of `layer_time` (`first_extra`, `last_extra`; in layers when `layer_time` is None). `owners[i]` is the
    rank running stage i (default: stage i on rank i); with interleaved or V schedules a rank runs several
    stages, and it is the rank's sum that matters. `layer_time[r]` is one layer's time on rank r (default
    1 each): on a mixed cluster a faster device gets more layers (Metis-style). `max_layers[r]` caps the
    layers rank r can hold in memory. Every stage keeps at least one layer (`empty_ends`: but the first and the
    last, which may hold the embedding alone or the head alone when their extra outweighs a layer); None when
    the caps leave no room. Greedy water-filling: each layer goes to the rank where it would finish first (ties to the
    middle of the pipeline), onto its stage with the fewest layers; for identical layers this minimises
    the busiest rank's time.
    """
    return _balanced(layers, stages, first_extra, last_extra, tuple(owners) if owners is not None else None,
                     tuple(layer_time) if layer_time is not None else None,
                     tuple(max_layers) if max_layers is not None else None, empty_ends and stages > 1)


@functools.lru_cache(maxsize=65536)
def _balanced(layers: int, stages: int, first_extra: float, last_extra: float, owners: tuple[int, ...] | None,
              layer_time: tuple[float, ...] | None, max_layers: tuple[int, ...] | None,
              empty_ends: bool = False) -> tuple[int, ...] | None:
    owners = owners if owners is not None else tuple(range(stages))
    ranks = max(owners) + 1
    cost = layer_time or (1.0,) * ranks
    # An end whose extra outweighs a layer starts empty (its layer, if it earns one, comes from the filling).
    empty = {index for index, extra in ((0, first_extra), (stages - 1, last_extra))
             if empty_ends and extra >= cost[owners[index]]}
    counts = [0 if stage in empty else 1 for stage in range(stages)]
    held = [0] * ranks
    busy = [0.0] * ranks
    for stage, rank in enumerate(owners):
        if stage not in empty:
            busy[rank] += cost[rank]
            held[rank] += 1
    if max_layers is not None and any(held[r] > max_layers[r] for r in range(ranks)):
        return None
    busy[owners[0]] += first_extra
    busy[owners[-1]] += last_extra
    stages_of: list[list[int]] = [[] for _ in range(ranks)]  # each rank's stages, in model order
    for stage, rank in enumerate(owners):
        stages_of[rank].append(stage)
    middle = (ranks - 1) / 2
    heap = [(busy[r] + cost[r], abs(r - middle), r) for r in range(ranks)
            if max_layers is None or held[r] < max_layers[r]]
    heapq.heapify(heap)
    for _ in range(layers - sum(counts)):
        if not heap:
            return None
        _, distance, rank = heapq.heappop(heap)
        mine = stages_of[rank]
        # fewest layers, first of ties; an empty end only when the rank has no other stage
        stage = mine[0] if len(mine) == 1 else min([s for s in mine if s not in empty] or mine,
                                                   key=counts.__getitem__)
        counts[stage] += 1
        held[rank] += 1
        busy[rank] += cost[rank]
        if max_layers is None or held[rank] < max_layers[rank]:
            heapq.heappush(heap, (busy[rank] + cost[rank], distance, rank))
    return tuple(counts)


def balanced_replicas(micro_batches: int, seconds_per_micro_batch: list[float], unit: int = 1,
                      minimum: int = 1) -> tuple[int, ...] | None:
    """Micro-batches per data-parallel replica, summing to `micro_batches`, so that the replica that
    finishes last finishes as early as possible (Cephalo-style: work in proportion to speed).

    Counts are multiples of `unit` (schedules that run in rounds of pp micro-batches) and at least
    `minimum` (a pipeline needs one per stage). Greedy: start every replica at the minimum, then give
    each further unit to the replica that would finish it first. None when no split meets the rules.
    """
    replicas = len(seconds_per_micro_batch)
    start = -(-minimum // unit) * unit
    spare = micro_batches - start * replicas
    if spare < 0 or spare % unit:
        return None
    counts = [start] * replicas
    heap = [((start + unit) * t, r) for r, t in enumerate(seconds_per_micro_batch)]
    heapq.heapify(heap)
    for _ in range(spare // unit):
        _, replica = heapq.heappop(heap)
        counts[replica] += unit
        heapq.heappush(heap, ((counts[replica] + unit) * seconds_per_micro_batch[replica], replica))
    return tuple(counts)


def cp_method_options(model: ModelSpec, tp: int, cp: int, choices: Choices, stack: SoftwareStack) -> list[str]:
    """Context-parallel methods for cp > 1 that the stack runs and the heads allow (Ulysses splits the heads
    and kv_heads of each tp rank over cp); with cp = 1 the method is moot and the default is kept."""
    if cp == 1:
        return ["allgather"]
    methods = [choices.cp_method] if choices.cp_method else list(stack.features.cp_methods)
    heads_split = (model.heads // tp) % cp == 0 and (model.kv_heads // tp) % cp == 0
    return [m for m in methods if m in stack.features.cp_methods and (m != "ulysses" or heads_split)]


def useful_cp_methods(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, degrees: tuple[int, int, int],
                      micro_batch: int, seconds: dict[str, float]) -> list[str]:
    """The cp methods worth searching for (tp, pp, cp), given each method's time on a probe (`seconds`).
    They differ only in the CP exchange and in the K/V all-gather keeps, so Ulysses dominates when faster
    (its memory is never higher); all-gather when at least as fast and what it keeps is under 5% of the
    device; else both (memory may decide)."""
    tp, pp, cp = degrees
    if len(seconds) < 2:
        return list(seconds)
    if seconds["allgather"] > seconds["ulysses"]:
        return ["ulysses"]
    kept = context_parallel_kept_bytes(model, train.seq_len, micro_batch, cp, "allgather",
                                       dtype_bytes(train.dtype)) / tp * -(-model.layers // pp)
    memory = min(group.device.memory_bytes for group in cluster.groups)
    return ["allgather"] if kept < 0.05 * memory else list(seconds)


def schedule_bound(schedule: str, pp: int, virtual: int, micro_batches: int, sums: list[float]) -> float:
    """A lower bound on the pipeline time of any split: with total work S = sum_r w_r and a bubble that is
    f x (S - max_r w_r) (cost/pipeline.py), time = (m - f) max_r w_r + f S >= S ((m - f) / p + f), since
    max_r w_r >= S / p."""
    total = sum(sums)
    if pp == 1:
        return micro_batches * total
    factor = bubble_ratio(schedule, pp, 1, virtual, *sums) / bubble_ratio("1f1b", pp, 1)
    return total * ((micro_batches - factor) / pp + factor)


def fixed_text(choices: Choices) -> str:
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in vars(choices).items()
                    if value is not None)
