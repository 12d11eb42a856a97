"""The credibility ceiling for MoE models (issue 25): the planner's best MoE plan on H100 stays at or below the
best measured MFU of its expert granularity plus 5 points (cost/credibility.py MOE_BEST_MEASURED_MFU), which is
the best row of the MoE development set (bench/reference/)."""

from __future__ import annotations

import csv
import pathlib
import sys

import pytest

from fivefold.cost import STACKS
from fivefold.cost.credibility import MOE_BEST_MEASURED_MFU, moe_granularity
from fivefold.planner import search
from fivefold.spec import PRESETS, TrainSpec, parse_cluster

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from reference_rows import H100_BF16_PEAK_TFLOPS, reference_model  # noqa: E402

# (stack, model, cluster, global batch): Megatron-Core's own MoE layouts and fivefold's, seq 4096, BF16; the dev
# set's models on the dev set's clusters (Qwen3-235B-A22B: ModelZoo; Mixtral 8x22B, Qwen2-57B-A14B: MoE Parallel
# Folding, Table 3).
CASES = [
    ("megatron-core", "qwen3-235b-a22b", "32x8xH100-SXM", 2048),
    ("megatron-core", "mixtral-8x22b", "16x8xH100-SXM", 256),
    ("megatron-core", "qwen2-57b-a14b", "8x8xH100-SXM", 256),
    ("megatron-core", "qwen3-30b-a3b", "2x8xH100-SXM", 512),
    ("fivefold", "qwen3-30b-a3b", "2x8xH100-SXM", 512),
    ("megatron-core", "mixtral-8x7b", "4x8xH100-SXM", 512),
]


@pytest.mark.parametrize("stack, model, cluster, batch", CASES)
def test_best_moe_plan_stays_within_five_points_of_the_best_measured(stack: str, model: str, cluster: str,
                                                                      batch: int) -> None:
    spec = PRESETS[model] if model in PRESETS else reference_model(model)
    ceiling = MOE_BEST_MEASURED_MFU["H100"][moe_granularity(spec.experts)] + 0.05
    found = search(spec, parse_cluster(cluster), TrainSpec(seq_len=4096, global_batch=batch), stack=STACKS[stack],
                   top=1)
    best = found.candidates[0]
    assert 0.1 < best.estimate.mfu <= ceiling, (best.plan.describe(), best.estimate.mfu)


def test_the_ceilings_are_the_best_measured_rows_of_the_moe_dev_set() -> None:
    best: dict[str, float] = {}
    for path in (ROOT / "bench" / "reference").glob("megatron_moe*_h100.csv"):
        with open(path) as handle:
            for row in csv.DictReader(handle):
                mfu = (float(row["mfu_pct"]) / 100 if row.get("mfu_pct")
                       else float(row["tflops_per_gpu"]) / H100_BF16_PEAK_TFLOPS)
                kind = moe_granularity(reference_model(row["model"]).experts)
                best[kind] = max(best.get(kind, 0.0), mfu)
    assert best == pytest.approx(MOE_BEST_MEASURED_MFU["H100"], abs=5e-4)
