"""A plan the search found: its key (step time with the simplicity margin) and what rebuilds it (planner/search.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.cost.layout import Layout
from fivefold.cost.results import Score
from fivefold.planner.mixed import PlacementOption


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
    option: PlacementOption | None = field(compare=False, default=None)  # None: identity, one device type
    replica_micro_batches: tuple[int, ...] = field(compare=False, default=())  # () = even
    cp_method: str = field(compare=False, default="allgather")
    etp: int = field(compare=False, default=1)  # expert tensor parallel (MoE parallel folding)
    vocab_parallel: bool = field(compare=False, default=False)  # embedding, head and loss over the pp ranks


def _found(score: Score, signature: tuple, variant: tuple[str, int], sequence_parallel: bool,
           layout: Layout, option: PlacementOption | None) -> _Found:
    dp, tp, pp, cp, ep, micro_batch, schedule, virtual = signature
    parts = (cp > 1) + (ep > 1) + (pp > 1) + (virtual > 1) + variant[1] + (variant[0] == "full") + layout.vocab_parallel
    return _Found(score.step_time_s * (1 + SIMPLICITY_MARGIN * parts), score.step_time_s, signature, variant[0],
                  variant[1], sequence_parallel, layout.layers_per_stage, option, layout.replica_micro_batches,
                  layout.cp_method, layout.etp, layout.vocab_parallel)
