"""Predicted vs measured step times of Megatron-LM GPT training on A100 (vTrain, Bang et al., MICRO 2024).

A fixed sample of rows is embedded here (every 60th single-node and every 6th multi-node row of the
vTrain data/ folder, MIT licence) so the check runs anywhere; the full tables are checked too when the
shared reference folder is present (bench/validate_cost_model.py writes the full report).
"""

import importlib.util
import pathlib
import statistics

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("validate_cost_model", ROOT / "bench" / "validate_cost_model.py")
validate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(validate)

from fivefold.cost import STACKS, estimate  # noqa: E402

# gpus, global batch, micro batch, hidden, heads, layers, seq, tp, dp, pp, measured ms
SINGLE_NODE = [
    (2, 16, 8, 1024, 16, 24, 1024, 1, 1, 2, 372.2), (8, 64, 4, 1024, 16, 12, 1024, 2, 4, 1, 183.6),
    (8, 64, 2, 2048, 16, 12, 1024, 1, 8, 1, 324.2), (8, 16, 1, 2048, 16, 16, 1024, 4, 2, 1, 416.9),
    (8, 64, 2, 2048, 16, 24, 1024, 1, 4, 2, 683.6), (8, 8, 4, 2048, 16, 20, 1024, 4, 1, 2, 169.6),
    (4, 16, 1, 2048, 16, 20, 1024, 2, 2, 1, 593.5), (4, 32, 1, 1024, 16, 20, 1024, 1, 4, 1, 545.4),
    (8, 64, 8, 2048, 16, 16, 1024, 2, 4, 1, 383.0), (8, 2, 1, 1024, 16, 16, 1024, 8, 1, 1, 164.8),
    (8, 64, 8, 1024, 16, 24, 1024, 1, 4, 2, 375.1), (4, 4, 2, 1024, 16, 24, 1024, 1, 1, 4, 120.2),
    (4, 64, 4, 1024, 16, 20, 1024, 1, 4, 1, 484.2), (2, 2, 1, 2048, 16, 24, 1024, 2, 1, 1, 184.6),
    (8, 32, 2, 1024, 16, 20, 1024, 1, 8, 1, 159.3), (8, 8, 1, 2048, 16, 20, 1024, 2, 2, 2, 195.0),
    (2, 4, 1, 2048, 16, 12, 1024, 1, 2, 1, 121.4), (4, 4, 1, 2048, 16, 12, 1024, 1, 1, 4, 117.4),
    (8, 16, 4, 1024, 16, 20, 1024, 4, 1, 2, 216.8), (8, 16, 4, 1024, 16, 20, 1024, 1, 2, 4, 168.9),
    (2, 16, 8, 1024, 16, 12, 1024, 1, 1, 2, 226.7), (4, 16, 4, 2048, 16, 20, 1024, 1, 2, 2, 354.8),
    (4, 32, 4, 2048, 16, 12, 1024, 2, 2, 1, 345.1), (4, 16, 2, 2048, 16, 16, 1024, 2, 1, 2, 381.4),
]
MULTI_NODE = [
    (64, 512, 8, 3072, 32, 30, 2048, 1, 64, 1, 3566.5), (64, 512, 2, 3072, 32, 30, 2048, 2, 32, 1, 4264.2),
    (64, 512, 2, 3072, 32, 30, 2048, 1, 32, 2, 4034.9), (64, 512, 8, 3072, 32, 30, 2048, 8, 8, 1, 5178.0),
    (64, 512, 4, 3072, 32, 30, 2048, 16, 4, 1, 11960.1), (256, 1024, 8, 6144, 48, 40, 2048, 4, 32, 2, 10856.3),
    (256, 1024, 2, 6144, 48, 40, 2048, 8, 8, 4, 10926.4), (512, 1536, 2, 8192, 64, 48, 2048, 4, 32, 4, 13875.5),
    (512, 1536, 3, 8192, 64, 48, 2048, 4, 16, 8, 17606.1), (512, 1536, 8, 8192, 64, 48, 2048, 8, 32, 2, 15212.8),
    (512, 1536, 4, 8192, 64, 48, 2048, 4, 8, 16, 15585.5), (512, 1536, 2, 8192, 64, 48, 2048, 8, 8, 8, 15001.9),
    (512, 1536, 12, 8192, 64, 48, 2048, 8, 16, 4, 17182.4), (512, 1536, 4, 8192, 64, 48, 2048, 8, 4, 16, 15944.5),
    (512, 1536, 12, 8192, 64, 48, 2048, 8, 4, 16, 18568.3),
]
KEYS = ("gpus", "global_batch", "micro_batch", "hidden", "heads", "layers", "seq_len", "tp", "dp", "pp")


def _rows(table):
    return [{**dict(zip(KEYS, row[:10])), "measured_s": row[10] / 1000} for row in table]


def _errors(rows):
    stack = STACKS["megatron-lm-2022"]
    return [estimate(validate.vtrain_plan(r), stack).step_time_s / r["measured_s"] - 1 for r in rows]


@pytest.mark.parametrize("table", [SINGLE_NODE, MULTI_NODE], ids=["single-node", "multi-node"])
def test_sampled_rows_within_ten_percent_mape(table):
    errors = _errors(_rows(table))
    assert statistics.fmean(abs(e) for e in errors) <= 0.10
    assert abs(statistics.fmean(errors)) <= 0.06  # no large systematic bias either way


def test_predicted_best_layout_of_the_39b_model_is_within_five_percent_of_the_measured_best():
    rows = [r for r in _rows(MULTI_NODE) if r["hidden"] == 8192]
    for row, error in zip(rows, _errors(rows)):
        row["predicted_s"] = row["measured_s"] * (1 + error)
    chosen = min(rows, key=lambda r: r["predicted_s"])
    assert chosen["measured_s"] <= 1.05 * min(r["measured_s"] for r in rows)


@pytest.mark.parametrize("name", ["vtrain_a100_single_node.csv", "vtrain_a100_multi_node.csv"])
def test_full_vtrain_tables(name):
    path = validate.DEFAULT_REFERENCE / name
    if not path.is_file():
        pytest.skip(f"reference table {path} is not on this machine (the sampled rows above still ran)")
    result = validate.evaluate_vtrain(validate.vtrain_rows(path))
    assert result["mape"] <= 0.10
    by_model = validate.regret_by_model(result["groups"])
    assert max(by_model.values()) <= 0.05
