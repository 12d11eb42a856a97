"""A test-only knob that makes chosen devices slower, so plans for mixed clusters can be measured on one CPU.

    FIVEFOLD_SLOW_DEVICES="1:3,3:2.5"

makes the transformer blocks that run on cluster device 1 take 3 times as long, and on device 3 2.5
times. Devices, not ranks: the plan's placement decides which rank runs on which device (rank r on device
plan.placement[r]), as on a real mixed cluster, so one setting describes the same hardware for every
plan. Describe the slow devices to the planner with the cluster group key `speed` (e.g. a group
`1x1xcpu:speed=0.33`), so it plans for what the knob does.

How: the forward and backward of every block (and of the final norm and LM head on the last stage) are
timed, wall clock, and right after each the rank sleeps (factor - 1) x that time, so the stage's compute
takes `factor` times as long, as on a slower device. Backward is timed by two identity autograd functions
per module: one on its output notes when the gradient arrives, one on its input when the module's
backward is through. Timing and sleeping per module keeps out, and keeps in order with, what happens
between modules: FSDP's parameter gathers and gradient reductions, which wait for the other ranks (a
rank must not sleep for time spent waiting on a slow peer, and a slow GPU finishes a block's backward
before that block's gradients are reduced). Sleep rather than extra arithmetic: on a machine with fewer
cores than processes extra work on one rank would steal cores from the others, while a sleeping rank
leaves its core to them, as a slow GPU slows only its own rank. Oversleeping is taken off the next sleep.
A process that sleeps wakes with cold caches: the slowdown comes out a few percent above `factor` on an
idle machine (3.3x for 3 on the test machine), more when other jobs take the core meanwhile. Numerics are
untouched: the functions pass tensors and gradients through unchanged, so losses are bit-identical.

Not slowed: the embedding, the loss, communication and the optimizer step; the separate weight-gradient
pass of the zero-bubble schedules (zb-h1, zbv), which does not pass through the functions. Recomputed
forwards (activation recompute) count as part of the backward they run in. On CUDA the device is
synchronized around each measurement, which costs overlap.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from fivefold.errors import SpecError
from fivefold.spec import Plan

ENV = "FIVEFOLD_SLOW_DEVICES"


def slow_factors(text: str) -> dict[int, float]:
    """'1:3,3:2.5' -> {1: 3.0, 3: 2.5}; '' -> {}."""
    factors: dict[int, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        device, sep, factor = item.partition(":")
        try:
            index, value = int(device), float(factor)
        except ValueError:
            index, value = -1, 0.0
        if not sep or index < 0 or value < 1:
            raise SpecError(ENV, text, "write DEVICE:FACTOR pairs separated by commas, e.g. 1:3,3:2.5 "
                                       "(cluster device indices, factors >= 1)")
        factors[index] = value
    return factors


def slow_down(model: nn.Module, plan: Plan, rank: int) -> nn.Module:
    """Attach the slowdown to `model` (one stage) when this rank's device is listed in the knob."""
    factor = slow_factors(os.environ.get(ENV, "")).get(plan.placement[rank], 1.0)
    timed = [*model.layers.values(), *(m for m in (model.norm, model.output) if m is not None)]
    if factor > 1.0:
        clock = _Clock(factor)
        for module in timed:
            clock.attach(module)
    return model


def _now(tensor: torch.Tensor) -> float:
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()


class _Clock:
    """The start of the module running now, and the sleep owed (negative after oversleeping)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.owed = 0.0
        self.forward_started = 0.0
        self.gradient_arrived = 0.0
        self.in_backward = False  # between a module's gradient arriving and its backward being through; a
        #                           forward seen then is activation recompute, timed as part of the backward

    def attach(self, module: nn.Module) -> None:
        def before(module: nn.Module, args: tuple) -> tuple:
            x = args[0]
            if not self.in_backward:
                self.forward_started = _now(x)
            return (_BackwardDone.apply(x, self), *args[1:]) if x.requires_grad else args

        def after(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            if not self.in_backward:
                self.sleep_for(_now(output) - self.forward_started)
            return _GradientArrives.apply(output, self) if output.requires_grad else output

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    def sleep_for(self, seconds: float) -> None:
        """Sleep (factor - 1) x `seconds`, less what earlier sleeps overshot."""
        self.owed += (self.factor - 1.0) * max(0.0, seconds)
        if self.owed > 0:
            started = time.perf_counter()
            time.sleep(self.owed)
            self.owed -= time.perf_counter() - started


class _GradientArrives(torch.autograd.Function):
    """Identity on a module's output; in backward, the moment the module's backward starts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: _Clock) -> torch.Tensor:
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.clock.in_backward = True
        ctx.clock.gradient_arrived = _now(grad)
        return grad, None


class _BackwardDone(torch.autograd.Function):
    """Identity on a module's input; in backward, the module's backward is through: sleep for it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: _Clock) -> torch.Tensor:
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        clock = ctx.clock
        clock.in_backward = False
        clock.sleep_for(_now(grad) - clock.gradient_arrived)
        return grad, None
