"""FP8 scaling recipes (cost/fp8.py, `--fp8-recipe`): each recipe's GEMMs and casts against the hand formula
from its sources, the BF16 weight gathers of rowwise, and the flag."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.cost import STACKS, estimate
from fivefold.cost.compute import Device, elementwise_time, gemm_time
from fivefold.cost.fp8 import FP8_RECIPES, gathers_fp8_weights, recipe_time_factor, with_fp8_recipe
from fivefold.cost.passwork import PassWork, fp8_linear
from fivefold.errors import SpecError
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster
from fivefold.spec.devices import CATALOG

TE_TABLE = Path(__file__).resolve().parent.parent / "bench" / "reference" / "te_h200nvl_gemm_layer.csv"
TOKENS, K, N = 8192, 4096, 14336


def _linear(recipe: str, stack_name: str = "torchtitan") -> tuple[PassWork, Device]:
    device = Device(CATALOG["H100-SXM"], "fp8")
    work = PassWork()
    fp8_linear(work, device, with_fp8_recipe(STACKS[stack_name], recipe), TOKENS, K, N)
    return work, device


def test_te_recipes_scale_the_linear_by_their_layer_time_over_current_scaling() -> None:
    with open(TE_TABLE) as handle:
        autocast = {r["recipe"]: float(r["layer_ms"]) for r in csv.DictReader(handle) if r["mode"] == "autocast"}
    for recipe in ("delayed", "blockwise"):
        assert recipe_time_factor(recipe) == pytest.approx(autocast[f"fp8-{recipe}"] / autocast["fp8-current"])
    assert recipe_time_factor("current") == recipe_time_factor("tensorwise") == 1.0
    reference, _ = _linear("tensorwise")
    current, _ = _linear("current")
    assert (current.forward, current.backward_input) == (reference.forward, reference.backward_input)
    delayed, _ = _linear("delayed")
    factor = 18.978 / 20.285
    for field in ("forward", "backward_input", "backward_weight"):
        assert getattr(delayed, field) == pytest.approx(factor * getattr(reference, field) -
                                                        (factor - 1) * _latency_terms(field), rel=1e-9)


def _latency_terms(field: str) -> float:
    """The per-kernel latencies of the casts, which the factor does not scale (elementwise_time adds them)."""
    device = Device(CATALOG["H100-SXM"], "fp8")
    return {"forward": 2, "backward_input": 4, "backward_weight": 0}[field] * device.latency


def test_rowwise_casts_every_operand_once_per_gemm_axis_and_runs_its_gemm_at_095() -> None:
    work, device = _linear("rowwise")
    x, g, w, cast = TOKENS * K, TOKENS * N, K * N, 3.0  # torchtitan compiles: fused casts, 3 bytes per element
    gemms = [gemm_time(device, TOKENS, N, K, fp8=True), gemm_time(device, TOKENS, K, N, fp8=True),
             gemm_time(device, K, N, TOKENS, fp8=True)]
    assert work.forward == pytest.approx(gemms[0] / 0.95 + elementwise_time(device, cast * (x + w), 2), rel=1e-9)
    assert work.backward_input == pytest.approx(gemms[1] / 0.95 + elementwise_time(device, cast * (2 * g + x + w), 4),
                                                rel=1e-9)
    assert work.backward_weight == pytest.approx(gemms[2] / 0.95, rel=1e-9)
    # Tensorwise: one cast per tensor and FP8 transposes; the weight cast happens before the FP8 all-gather.
    tensorwise, _ = _linear("tensorwise")
    assert tensorwise.forward == pytest.approx(gemms[0] + elementwise_time(device, cast * x, 2), rel=1e-9)


def test_rowwise_gathers_its_weights_in_bf16() -> None:
    titan = STACKS["torchtitan"]
    assert gathers_fp8_weights(titan) and not gathers_fp8_weights(with_fp8_recipe(titan, "rowwise"))
    model = replace(PRESETS["llama3-8b"], max_seq_len=8192)
    plan = Plan(model=model, cluster=parse_cluster("1x8xH100-96GB"), dp=8, zero=3, micro_batch=1,
                train=TrainSpec(seq_len=8192, global_batch=8, dtype="fp8"), recompute="selective")
    tensorwise, rowwise = estimate(plan, titan), estimate(plan, with_fp8_recipe(titan, "rowwise"))
    assert rowwise.breakdown_s["dp_comm"] >= tensorwise.breakdown_s["dp_comm"]
    assert rowwise.memory.total > tensorwise.memory.total  # the gathered weights: 2 bytes, not 1
    assert rowwise.tokens_per_s < tensorwise.tokens_per_s


def test_megatron_core_trains_fp8_with_delayed_scaling_and_the_flag_picks_a_recipe(capsys) -> None:
    assert STACKS["megatron-core"].fp8_recipe == "delayed" and STACKS["torchtitan"].fp8_recipe == "tensorwise"
    assert set(FP8_RECIPES) == {"tensorwise", "rowwise", "current", "delayed", "blockwise"}
    with pytest.raises(SpecError):
        with_fp8_recipe(STACKS["torchtitan"], "mxfp8")
    flags = ["estimate", "--model", "llama3-8b", "--cluster", "1x8xH100-SXM", "--dp", "8", "--zero", "3",
             "--dtype", "fp8", "--seq-len", "4096", "--global-batch", "8", "--stack", "torchtitan", "--json"]
    assert main([*flags, "--fp8-recipe", "bogus"]) == 2
    assert "error: --fp8-recipe='bogus': use one of tensorwise, rowwise, current, delayed, blockwise" in \
        capsys.readouterr().err
    speeds = {}
    for recipe in ("tensorwise", "rowwise"):
        assert main([*flags, "--fp8-recipe", recipe]) == 0
        speeds[recipe] = capsys.readouterr().out
    assert speeds["tensorwise"] != speeds["rowwise"]
