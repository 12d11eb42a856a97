"""FP8 scaling recipes: how each one's block GEMMs and quantization cost next to dynamic tensorwise scaling
(cost/passwork.py fp8_linear charges them; `--fp8-recipe` picks one).

- tensorwise (torchao's default) and current (Transformer Engine's Float8CurrentScaling): one scale per tensor
  from its amax now; cuBLAS's tensorwise FP8 GEMM. The op model's FP8 GEMMs and casts (cost/compute.py,
  cost/passwork.py) reproduce TE's current-scaling layer speed-up (1.58x over BF16 measured, 1.58x modelled:
  bench/reference/te_h200nvl_gemm_layer.csv, printed by bench/validate_cost_model.py): the reference recipe.
- delayed (TE's DelayedScaling) and blockwise (TE's Float8BlockScaling, 1x128 / 128x128 blocks): their layer
  time (GEMMs + quantization, `autocast` rows of the same table: 18.978 and 22.882 ms against current's
  20.285 ms per layer, TransformerEngine docs/examples/gemm_profiling at 1609c89, H200 NVL) over current's;
  the factor scales the FP8 linear's GEMMs and casts alike.
- rowwise (torchao's Float8 rowwise): a scale per row of each operand along the contraction, so each of input,
  weight and output gradient is cast twice from BF16, once per GEMM axis, where tensorwise casts once and
  transposes the FP8 copy; its GEMM is PyTorch's CUTLASS row-wise kernel, "most shapes within 90-100% of
  tensor-wise efficiency" with fast accumulation (pytorch/pytorch issue 147971): 0.95 here; and FSDP and TP
  gather its weights in BF16 (torchao's FP8 all-gather is tensorwise only: torchtitan's parallelize code,
  "float8 all-gather with TP is only supported for tensorwise"; torchao float8 README's training table,
  "rowwise with bfloat16 all-gather").
"""

from __future__ import annotations

from dataclasses import replace

from fivefold.cost.stack import SoftwareStack
from fivefold.errors import SpecError

FP8_RECIPES = ("tensorwise", "rowwise", "current", "delayed", "blockwise")
# TE's per-layer GEMM time with quantization (autocast), ms, H200 NVL: te_h200nvl_gemm_layer.csv.
TE_AUTOCAST_LAYER_MS = {"current": 20.285, "delayed": 18.978, "blockwise": 22.882}
ROWWISE_GEMM_EFFICIENCY = 0.95  # of the tensorwise FP8 GEMM (pytorch/pytorch#147971: most shapes 90-100%)


def recipe_time_factor(recipe: str) -> float:
    """The recipe's FP8 linear time (GEMMs and casts) over dynamic tensorwise scaling's, for the TE recipes;
    rowwise's GEMM time over tensorwise's (its casts are counted apart: rowwise_casts)."""
    if recipe in ("delayed", "blockwise"):
        return TE_AUTOCAST_LAYER_MS[recipe] / TE_AUTOCAST_LAYER_MS["current"]
    if recipe == "rowwise":
        return 1.0 / ROWWISE_GEMM_EFFICIENCY
    return 1.0


def gathers_fp8_weights(stack: SoftwareStack) -> bool:
    """ZeRO-3 gathers the block weights already cast to FP8: the stack can, and the recipe is tensorwise."""
    return stack.features.fp8_all_gather and stack.fp8_recipe != "rowwise"


def with_fp8_recipe(stack: SoftwareStack, recipe: str | None) -> SoftwareStack:
    """`stack` training FP8 with `recipe` (None: the stack as it is)."""
    if recipe is None or recipe == stack.fp8_recipe:
        return stack
    if recipe not in FP8_RECIPES:
        raise SpecError("--fp8-recipe", recipe, f"use one of {', '.join(FP8_RECIPES)}")
    runs = stack.features.fp8_recipes
    if runs and recipe not in runs:  # what `fivefold train` refuses, the plan for its stack refuses too
        raise SpecError("--fp8-recipe", recipe, f"the {stack.name} stack trains FP8 with {' or '.join(runs)} scaling; "
                        f"{recipe} is priced for --stack megatron-core")
    return replace(stack, fp8_recipe=recipe)
