"""The credibility ceiling for MoE models (issue 25): the planner's best MoE plan on H100 stays at or below the
best measured MFU of its expert granularity plus 5 points (cost/credibility.py MOE_BEST_MEASURED_MFU)."""

from __future__ import annotations

import pytest

from fivefold.cost import STACKS
from fivefold.cost.credibility import MOE_BEST_MEASURED_MFU, moe_granularity
from fivefold.planner import search
from fivefold.spec import PRESETS, TrainSpec, parse_cluster

# (stack, model, cluster, global batch): Megatron-Core's own MoE layouts and fivefold's, seq 4096, BF16.
CASES = [
    ("megatron-core", "qwen3-235b-a22b", "32x8xH100-SXM", 2048),  # the MoE dev set's model and cluster
    ("megatron-core", "qwen3-30b-a3b", "2x8xH100-SXM", 512),
    ("fivefold", "qwen3-30b-a3b", "2x8xH100-SXM", 512),
    ("megatron-core", "mixtral-8x7b", "4x8xH100-SXM", 512),
]


@pytest.mark.parametrize("stack, model, cluster, batch", CASES)
def test_best_moe_plan_stays_within_five_points_of_the_best_measured(stack: str, model: str, cluster: str,
                                                                      batch: int) -> None:
    spec = PRESETS[model]
    ceiling = MOE_BEST_MEASURED_MFU["H100"][moe_granularity(spec.experts)] + 0.05
    found = search(spec, parse_cluster(cluster), TrainSpec(seq_len=4096, global_batch=batch), stack=STACKS[stack],
                   top=1)
    best = found.candidates[0]
    assert 0.1 < best.estimate.mfu <= ceiling, (best.plan.describe(), best.estimate.mfu)
