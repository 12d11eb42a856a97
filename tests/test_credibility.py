"""Credible predictions (issue 17): the planner's best plans stay within what real systems reached, estimates
outside the development set say so, and each carries the error band of its stack and device class."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from dataclasses import replace

import pytest

from fivefold.cli import main
from fivefold.cost import STACKS, estimate
from fivefold.cost.credibility import COVERAGE, ERROR_BANDS, UNMEASURED_BAND
from fivefold.planner import search
from fivefold.spec import PRESETS, ModelSpec, Plan, TrainSpec, parse_cluster

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
_spec = importlib.util.spec_from_file_location("validate_cost_model", ROOT / "bench" / "validate_cost_model.py")
validate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(validate)
REFERENCE = validate.DEFAULT_REFERENCE
needs_reference = pytest.mark.skipif(not REFERENCE.is_dir(), reason="shared/reference is not beside the repository")


@pytest.fixture(scope="module")
def report():
    """The development set, predicted (about 4 s)."""
    from reference_rows import megatron_core_rows, torchtitan_rows
    from validation_report import Report

    vtrain = [(name, validate.evaluate_vtrain(validate.vtrain_rows(REFERENCE / name)))
              for name in ("vtrain_a100_multi_node.csv", "vtrain_a100_single_node.csv")]
    plans = [validate.vtrain_plan(r) for _, result in vtrain for r in result["rows_list"]]
    return Report(REFERENCE, vtrain, megatron_core_rows(REFERENCE / "megatron_core_h100.csv"),
                  validate.zero_bubble_rows(REFERENCE / "zero_bubble_a100.csv"),
                  torchtitan_rows(REFERENCE / "torchtitan_h100.csv"), [], plans)


@needs_reference
def test_bands_and_coverage_are_what_the_development_set_gives(report) -> None:
    assert report.bands == ERROR_BANDS
    for cls, cover in report.coverage.items():
        assert {k: getattr(COVERAGE[cls], k) for k in cover} == cover


def _gpt(layers: int, hidden: int, heads: int, seq: int) -> ModelSpec:
    return validate.gpt(layers, hidden, heads, seq)


def _mcore(layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name="mcore", layers=layers, hidden=hidden, heads=heads, mlp="gelu", norm="layernorm",
                     position="rope", vocab=131072, max_seq_len=4096)


# (stack, model, cluster, seq_len, global batch, dtype): the reference tables' models and clusters.
CASES = [
    ("megatron-lm-2022", _gpt(30, 3072, 32, 2048), "8x8xA100-80GB", 2048, 512, "fp16"),
    ("megatron-lm-2022", _gpt(40, 6144, 48, 2048), "32x8xA100-80GB", 2048, 1024, "fp16"),
    ("megatron-lm-2022", _gpt(48, 8192, 64, 2048), "64x8xA100-80GB", 2048, 1536, "fp16"),
    ("megatron-lm-2022", _gpt(62, 6144, 48, 1024), "4x8xA100-80GB", 1024, 256, "bf16"),
    # Issue 17's GPT-3 175B (batch 1536 as in Narayanan et al. 2021), in the default dtype, on 256 and 1536 A100.
    ("megatron-lm-2022", PRESETS["gpt3-175b"], "32x8xA100-80GB", 2048, 1536, "bf16"),
    ("megatron-lm-2022", PRESETS["gpt3-175b"], "192x8xA100-80GB", 2048, 1536, "bf16"),
    ("megatron-core", _mcore(24, 2048, 16), "6x8xH100-SXM", 4096, 192, "bf16"),
    ("megatron-core", _mcore(48, 7168, 56), "48x8xH100-SXM", 4096, 192, "bf16"),
    ("megatron-core", _mcore(96, 16384, 128), "384x8xH100-SXM", 4096, 1536, "bf16"),
    ("torchtitan", PRESETS["llama3-8b"], "1x8xH100-96GB", 8192, 16, "fp8"),
    ("torchtitan", PRESETS["llama3-8b"], "16x8xH100-96GB", 8192, 256, "fp8"),
    ("torchtitan", PRESETS["llama3-70b"], "32x8xH100-96GB", 8192, 512, "fp8"),
    ("torchtitan", PRESETS["llama3-405b"], "64x8xH100-96GB", 8192, 256, "fp8"),
]


@needs_reference
def test_best_plans_stay_within_five_points_of_the_best_measured_mfu(report) -> None:
    ceiling = {cls: mfu + 0.05 for cls, mfu in report.best_measured_mfu().items()}
    assert ceiling["A100"] == pytest.approx(0.62, abs=0.01) and ceiling["H100"] == pytest.approx(0.592, abs=0.01)
    for stack, model, cluster, seq, batch, dtype in CASES:
        found = search(replace(model, max_seq_len=max(model.max_seq_len, seq)), parse_cluster(cluster),
                       TrainSpec(seq_len=seq, global_batch=batch, dtype=dtype), stack=STACKS[stack], top=1)
        best = found.candidates[0].estimate
        assert best.mfu <= ceiling[cluster.split("x")[2][:4]], (stack, cluster, found.candidates[0].plan.describe())


def _plan(cluster: str, **fields: object) -> Plan:
    model = replace(PRESETS["llama3-8b"], max_seq_len=8192)
    return Plan(model=model, cluster=parse_cluster(cluster), train=TrainSpec(seq_len=8192, global_batch=16),
                zero=3, **fields)


def test_extrapolation_is_one_line_naming_what_no_row_covers() -> None:
    inside = estimate(_plan("1x8xH100-96GB", dp=8, micro_batch=2, recompute="selective"), STACKS["torchtitan"])
    assert not any(n.startswith("extrapolating") for n in inside.notes)
    assert inside.error_band == ERROR_BANDS[("torchtitan", "H100")]
    wide_cp = estimate(_plan("2x8xH100-96GB", cp=16, dp=1, recompute="full"), STACKS["torchtitan"])
    assert "extrapolating: no measured row with cp > 8 on H100" in wide_cp.notes
    a100 = estimate(_plan("1x8xA100-80GB", cp=2, dp=4, recompute="full"), STACKS["megatron-lm-2022"])
    assert "extrapolating: no measured row with cp > 1 or seq_len 8192 or ZeRO-3 or recompute full on A100" \
        not in a100.notes  # full recompute is measured on A100 (vTrain)
    assert "extrapolating: no measured row with cp > 1 or seq_len 8192 or ZeRO-3 on A100" in a100.notes
    h200 = estimate(_plan("1x8xH200", dp=8), STACKS["torchtitan"])
    assert "extrapolating: no measured row on H200" in h200.notes and h200.error_band == UNMEASURED_BAND
    assert UNMEASURED_BAND == 2 * max(ERROR_BANDS.values())


def test_estimate_and_plan_show_band_and_extrapolation(capsys) -> None:
    common = ["--model", "llama3-8b", "--cluster", "1x8xH100-96GB", "--seq-len", "8192", "--global-batch", "16",
              "--stack", "torchtitan"]
    assert main(["estimate", *common, "--cp", "8", "--zero", "3", "--recompute", "full", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["error_band"] == ERROR_BANDS[("torchtitan", "H100")] and data["notes"] == []
    assert main(["estimate", *common, "--pp", "2", "--dp", "4", "--schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert f"+-{ERROR_BANDS[('torchtitan', 'H100')]:.0%}" in out
    assert "note: extrapolating: no measured row with schedule zb-h1 or ZeRO-0 on H100" in " ".join(out.split())
    assert main(["plan", *common, "--top", "2", "--dtype", "fp8", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "#1 note: extrapolating:" in out and f"+-{ERROR_BANDS[('torchtitan', 'H100')]:.0%}" in out
    assert "MFU is of the BF16 peak (GEMMs in FP8)" in out


def test_torchtitan_pipeline_rows_split_the_local_batch_into_pp_micro_batches() -> None:
    """TorchTitan 9dec370 (the benchmark's version) runs `pipeline_parallel_microbatches or pp` micro-batches:
    Table 5's local batch of 32 on pp 8 is 8 micro-batches of 4 sequences, Table 6's 8 is 8 of one."""
    from reference_rows import torchtitan_plan

    row = {"model": "llama3.1-405b", "gpus": "512", "fsdp": "8", "tp": "8", "pp": "8", "cp": "1", "seq_len": "8192",
           "local_batch": "32", "global_batch": "256", "schedule": "1f1b", "activation_checkpoint": "full",
           "compile": "yes", "float8": "yes", "async_tp": "yes"}
    plan, _ = torchtitan_plan(row)
    assert (plan.micro_batch, plan.num_micro_batches) == (4, 8)
    plan, _ = torchtitan_plan({**row, "seq_len": "32768", "local_batch": "8", "global_batch": "64"})
    assert (plan.micro_batch, plan.num_micro_batches) == (1, 8)
