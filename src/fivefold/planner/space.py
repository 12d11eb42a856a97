"""The search space: which degrees, micro-batches, schedules, recompute and ZeRO levels a plan may use.

Every option listed here is valid for Plan.validate; options that can never win are left out up front
(dominated): sequence parallelism is always on with tp > 1 (same communication volume, less memory and
element-wise work), ZeRO-0 loses to ZeRO-1 whenever there is more than one replica (same traffic, less
memory, shorter optimizer step), GPipe loses to 1F1B (same time, more memory) and selective recompute
equals no recompute when attention is fused (FlashAttention already recomputes the scores). A choice the
user fixes is always kept, dominated or not.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

from fivefold.cost.stack import SoftwareStack
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
    micro_batch: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    zero: int | None = None
    layers_per_stage: tuple[int, ...] | None = None


def _allowed(value: int, fixed: int | None) -> bool:
    return fixed is None or value == fixed


def degree_options(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                   choices: Choices) -> list[tuple[int, int, int, int, int]]:
    """Every (dp, tp, pp, cp, ep) whose product is the world size and that Plan.validate accepts."""
    world = cluster.world_size
    mlp_width = model.expert_ffn_hidden if model.is_moe else model.ffn_hidden
    out = []
    for tp in divisors(world):
        if not _allowed(tp, choices.tp) or model.heads % tp or model.kv_heads % tp or mlp_width % tp:
            continue
        for pp in divisors(world // tp):
            if not _allowed(pp, choices.pp) or pp > model.layers:
                continue
            for cp in divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                if not _allowed(cp, choices.cp) or not _allowed(dp, choices.dp) or train.seq_len % cp:
                    continue
                if train.global_batch % dp:
                    continue
                if model.is_moe:
                    experts_options = [ep for ep in divisors(dp * cp) if model.experts % ep == 0]
                else:
                    experts_options = [1]
                for ep in experts_options:
                    if _allowed(ep, choices.ep):
                        out.append((dp, tp, pp, cp, ep))
    return out


def micro_batch_options(train: TrainSpec, dp: int, choices: Choices) -> list[int]:
    """Sequences per micro-batch, smallest first (memory grows with it)."""
    per_replica = train.global_batch // dp
    return [b for b in divisors(per_replica) if _allowed(b, choices.micro_batch)]


def schedule_options(model: ModelSpec, pp: int, micro_batches: int, choices: Choices) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs valid for this pipeline."""
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
    return [(s, v) for s, v in options if (choices.schedule is None or s == choices.schedule)
            and _allowed(v, choices.virtual_stages)]


def recompute_options(stack: SoftwareStack, choices: Choices) -> list[str]:
    """Cheapest first: none, (selective), full."""
    if choices.recompute is not None:
        return [choices.recompute]
    return ["none", "full"] if stack.attention == "flash" else ["none", "selective", "full"]


def zero_options(dp: int, cp: int, choices: Choices) -> list[int]:
    """Fastest first; with one replica every level is the same plan, so only 0."""
    if choices.zero is not None:
        return [choices.zero]
    return [0] if dp * cp == 1 else [1, 2, 3]


def sequence_parallel_option(tp: int, choices: Choices) -> bool:
    if choices.sequence_parallel is not None:
        return choices.sequence_parallel and tp > 1
    return tp > 1


def balanced_layers(layers: int, stages: int, first_extra: float, last_extra: float,
                    owners: list[int] | tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Split `layers` over `stages` so the busiest pipeline rank is as little busy as possible.

    The first stage also runs the embedding and the last the LM head; their cost is given in layers
    (`first_extra`, `last_extra`). `owners[i]` is the rank running stage i (default: stage i on rank i);
    with interleaved or V schedules a rank runs several stages, and it is the rank's sum that matters.
    Every stage keeps at least one layer. Greedy water-filling: each layer goes to the least busy rank
    (ties to the middle of the pipeline), onto its stage with the fewest layers.
    """
    return _balanced(layers, stages, first_extra, last_extra, tuple(owners) if owners is not None else None)


@functools.lru_cache(maxsize=65536)
def _balanced(layers: int, stages: int, first_extra: float, last_extra: float,
              owners: tuple[int, ...] | None) -> tuple[int, ...]:
    owners = owners if owners is not None else tuple(range(stages))
    ranks = max(owners) + 1
    counts = [1] * stages
    busy = [0.0] * ranks
    for stage, rank in enumerate(owners):
        busy[rank] += 1
    busy[owners[0]] += first_extra
    busy[owners[-1]] += last_extra
    stages_of = [[i for i in range(stages) if owners[i] == r] for r in range(ranks)]
    middle = (ranks - 1) / 2
    heap = [(busy[r], abs(r - middle), r) for r in range(ranks)]
    heapq.heapify(heap)
    for _ in range(layers - stages):
        _, distance, rank = heapq.heappop(heap)
        mine = stages_of[rank]
        stage = mine[0] if len(mine) == 1 else min(mine, key=lambda i: (counts[i], i))
        counts[stage] += 1
        busy[rank] += 1
        heapq.heappush(heap, (busy[rank], distance, rank))
    return tuple(counts)
