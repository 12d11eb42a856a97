"""A test-only knob that makes chosen devices slower, so plans for mixed clusters can be measured on one CPU.

    FIVEFOLD_SLOW_DEVICES="1:3,3:2.5"

makes the transformer blocks that run on cluster device 1 take 3 times as long, and on device 3 2.5
times. Devices, not ranks: the plan's placement decides which rank runs on which device (rank r on device
plan.placement[r]), as on a real mixed cluster, so one setting describes the same hardware for every
plan. Describe the slow devices to the planner with the cluster group key `speed` (e.g. a group
`1x1xcpu:speed=0.33`), so it plans for what the knob does.

How: the forward and backward of every block (and of the final norm and LM head on the last stage) are
timed, wall clock, and (factor - 1) x that time is owed; the debt is paid by sleeping at the end of each
pass over the stage (after the last module's forward, after the first block's backward), so the stage's
compute takes `factor` times as long, as on a slower device. Backward is timed by two identity autograd
functions per module: one on its output notes when the gradient arrives, one on its input when the
module's backward is through. Timing each module rather than the whole pass keeps out what happens
between modules: FSDP's parameter gathers and gradient reductions, which wait for the other ranks (a
rank that waited for a slow peer must not sleep for it). Sleep rather than extra arithmetic: on a
machine with fewer cores than processes extra work on one rank would steal cores from the others, while
a sleeping rank leaves its core to them, as a slow GPU slows only its own rank. One sleep per pass
rather than per module: a process that sleeps loses its caches, and waking cold after every block made
blocks ~40% slower on the test machine. Oversleeping is taken off the next sleep. Numerics are
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
    if factor > 1.0 and timed:
        clock = _StageClock(factor)
        for index, module in enumerate(timed):
            clock.attach(module, first=index == 0, last=index == len(timed) - 1)
    return model


def _now(tensor: torch.Tensor) -> float:
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()


class _StageClock:
    """The sleep one stage owes, and the start of the module running now."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.owed = 0.0  # seconds of sleep owed; negative after oversleeping
        self.forward_started = 0.0  # of the module running forward now
        self.gradient_arrived = 0.0  # at the module running backward now
        self.in_backward = False  # from the stage's first gradient to its first block's; a forward seen
        #                           then is activation recompute, already timed as part of the backward

    def attach(self, module: nn.Module, first: bool, last: bool) -> None:
        def before(module: nn.Module, args: tuple) -> tuple:
            x = args[0]
            if not self.in_backward:
                self.forward_started = _now(x)
            return (_BackwardDone.apply(x, self, first), *args[1:]) if x.requires_grad else args

        def after(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            if not self.in_backward:
                self.owe(_now(output) - self.forward_started)
                if last:
                    self.pay()
            return _GradientArrives.apply(output, self) if output.requires_grad else output

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    def owe(self, seconds: float) -> None:
        self.owed += (self.factor - 1.0) * max(0.0, seconds)

    def pay(self) -> None:
        """Sleep what is owed; oversleeping is taken off the next time."""
        if self.owed > 0:
            started = time.perf_counter()
            time.sleep(self.owed)
            self.owed -= time.perf_counter() - started


class _GradientArrives(torch.autograd.Function):
    """Identity on a module's output; in backward, the moment the module's backward starts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: _StageClock) -> torch.Tensor:
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.clock.in_backward = True
        ctx.clock.gradient_arrived = _now(grad)
        return grad, None


class _BackwardDone(torch.autograd.Function):
    """Identity on a module's input; in backward, the module's backward is through: owe for it, and
    after the stage's first block pay."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: _StageClock, first: bool) -> torch.Tensor:
        ctx.clock, ctx.first = clock, first
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        clock = ctx.clock
        clock.owe(_now(grad) - clock.gradient_arrived)
        if ctx.first:
            clock.in_backward = False
            clock.pay()
        return grad, None, None
