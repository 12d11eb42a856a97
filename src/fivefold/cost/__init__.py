"""The analytical cost model: FLOPs, memory, kernel and collective times, pipeline bubbles, step time.

Pure Python, no torch. `estimate(plan)` is the entry point; `model_flops_per_step(model, train)` is the
MFU numerator shared with the runtime.
"""

from fivefold.cost.flops import hardware_flops_per_step, model_flops_per_step, narayanan_flops
from fivefold.cost.layout import Layout
from fivefold.cost.memory import korthikanti_activation_bytes, zero_model_state_bytes
from fivefold.cost.pipeline import bubble_ratio
from fivefold.cost.stack import STACKS, DataParallelSync, SoftwareStack, data_parallel_sync, stack_named
from fivefold.cost.results import Estimate, Score, StageCost
from fivefold.cost.step import estimate, estimate_layout, score_layout

__all__ = ["DataParallelSync", "Estimate", "Layout", "STACKS", "Score", "SoftwareStack", "StageCost", "bubble_ratio",
           "data_parallel_sync", "estimate", "estimate_layout", "score_layout", "hardware_flops_per_step",
           "korthikanti_activation_bytes", "model_flops_per_step", "narayanan_flops", "stack_named",
           "zero_model_state_bytes"]
