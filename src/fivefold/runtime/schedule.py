"""The learning-rate schedules and the AdamW settings of a run, as plain numbers (no torch import: the CLI
checks them before anything heavy loads, and the checkpoint records them as JSON).

Every schedule starts with a linear warmup to the peak over `warmup_steps`, then:
    cosine    half a cosine from the peak (the first step after the warmup) down to min_lr at the last step
              (Chinchilla, Llama); a single step after the warmup runs at min_lr;
    linear    a straight line from the peak down to min_lr at the last step;
    constant  the peak until the end;
    wsd       warmup-stable-decay (MiniCPM, DeepSeek): the peak until the last `decay_steps` steps, which fall
              linearly to min_lr at the last step.
A warmup that takes every step leaves no decay: such a run ends at the peak.
"""

from __future__ import annotations

import math
from typing import Any

from fivefold.errors import SpecError, require

LR_SCHEDULES = ("cosine", "wsd", "linear", "constant")
MIN_LR_RATIO = 0.1  # default min_lr: 10% of the peak (Chinchilla, Llama)
WSD_DECAY_FRACTION = 0.2  # default decay of WSD: the last 20% of the steps (MiniCPM's 10-20%)


def parse_betas(text: str) -> tuple[float, float]:
    """'0.9,0.95' -> (0.9, 0.95); each in [0, 1)."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        betas = tuple(float(p) for p in parts)
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in betas):
        raise SpecError("--betas", text, "must be two numbers in [0, 1) separated by a comma, e.g. 0.9,0.95")
    return betas  # type: ignore[return-value]


def effective_min_lr(peak_lr: float, min_lr: float | None) -> float:
    return MIN_LR_RATIO * peak_lr if min_lr is None else min_lr


def effective_decay_steps(schedule: str, decay_steps: int | None, total_steps: int, warmup_steps: int) -> int | None:
    """WSD's decay length (given, or the last 20% of the steps after warmup, at least 1); None for the others."""
    if schedule != "wsd":
        return None
    if decay_steps is not None:
        return decay_steps
    return max(1, round(WSD_DECAY_FRACTION * max(1, total_steps - warmup_steps)))


def lr_at(step: int, peak_lr: float, warmup_steps: int, total_steps: int, schedule: str = "cosine",
          min_lr: float | None = None, decay_steps: int | None = None) -> float:
    """Learning rate of 0-based optimizer step `step` (see the module docstring)."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    floor = effective_min_lr(peak_lr, min_lr)
    if schedule == "constant":
        return peak_lr
    if schedule == "wsd":
        decay = effective_decay_steps(schedule, decay_steps, total_steps, warmup_steps)
        assert decay is not None
        decay_start = total_steps - decay
        if step < decay_start:
            return peak_lr
        progress = min(1.0, (step - decay_start + 1) / decay)
        return peak_lr - (peak_lr - floor) * progress
    # The first step after the warmup runs at the peak and the last at min_lr; with a single step after the
    # warmup that step is the last one, so it runs at min_lr.
    decay = total_steps - warmup_steps
    progress = 1.0 if decay <= 1 else min(1.0, (step - warmup_steps) / (decay - 1))
    if schedule == "linear":
        return peak_lr - (peak_lr - floor) * progress
    return floor + 0.5 * (peak_lr - floor) * (1.0 + math.cos(math.pi * progress))


def check_optimizer_flags(lr: float, steps: int, warmup_steps: int, schedule: str, min_lr: float | None,
                          decay_steps: int | None, weight_decay: float, betas: str, eps: float) -> None:
    """One SpecError line on the first optimizer or schedule flag that cannot work."""
    require(schedule in LR_SCHEDULES, "--lr-schedule", schedule, f"use one of {', '.join(LR_SCHEDULES)}")
    if min_lr is not None:
        require(math.isfinite(min_lr) and 0 <= min_lr <= lr, "--min-lr", min_lr,
                f"must be a finite number from 0 to --lr ({lr:g})")
        require(schedule != "constant", "--min-lr", min_lr, "the constant schedule never decays; use "
                                                            "--lr-schedule cosine, linear or wsd")
    if decay_steps is not None:
        require(schedule == "wsd", "--decay-steps", decay_steps, "only --lr-schedule wsd has a decay phase of "
                                                                 "its own; add --lr-schedule wsd")
        require(1 <= decay_steps <= steps - warmup_steps, "--decay-steps", decay_steps,
                f"must be from 1 to --steps minus --warmup-steps ({steps - warmup_steps})")
    require(math.isfinite(weight_decay) and weight_decay >= 0, "--weight-decay", weight_decay,
            "must be a finite number, 0 or more, e.g. 0.1")
    parse_betas(betas)
    require(math.isfinite(eps) and eps > 0, "--eps", eps, "must be a positive finite number, e.g. 1e-8")


def optimizer_record(schedule: str, min_lr: float | None, decay_steps: int | None, weight_decay: float,
                     betas: str, eps: float) -> dict[str, Any]:
    """The settings a checkpoint records and a resume must repeat, as given (plain JSON values). min_lr and
    decay_steps stay null when they follow --lr and --steps, which a resume may change (e.g. more steps)."""
    return {"lr_schedule": schedule, "min_lr": min_lr, "decay_steps": decay_steps, "weight_decay": weight_decay,
            "betas": list(parse_betas(betas)), "eps": eps}
