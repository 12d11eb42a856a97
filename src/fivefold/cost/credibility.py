"""What makes an estimate credible: what the stack cannot run, and where the prediction extrapolates.

`annotate` adds one-line notes to an Estimate (shown by `estimate` and `plan`, and in their JSON).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fivefold.cost.stack import SoftwareStack, unsupported_features
from fivefold.spec.plan import Plan

if TYPE_CHECKING:
    from fivefold.cost.step import Estimate


def annotate(estimate: Estimate, plan: Plan, stack: SoftwareStack) -> Estimate:
    if plan.train.dtype == "fp8":
        estimate.mfu_basis = "BF16 peak (GEMMs in FP8)"
    missing = unsupported_features(stack, plan)
    if missing:
        estimate.notes.append(f"the {stack.name} stack cannot run this plan: {', '.join(missing)}")
    return estimate
