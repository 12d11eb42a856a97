"""Test-only fault knobs, set by environment variables and applied to a worker from outside its loop.

    FIVEFOLD_SLOW_DEVICES="1:3"     devices that compute slower (runtime/slowdown.py)
    FIVEFOLD_INJECT_LOSS="3:nan"    losses of chosen global batches multiplied by NaN, Inf or a factor
                                    (elastic/guard.py parses it)
    FIVEFOLD_HANG_AT="1:4"          a rank that stops participating at a step (elastic/hang.py parses it)

The launcher's worker entry reads them once (`FaultKnobs.from_env`) and hands them to `train`; a run without
them gets NO_KNOBS, whose hooks change nothing, and the training loop itself never reads the environment.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from fivefold.elastic.guard import injected_loss_factors
from fivefold.elastic.hang import hang_point
from fivefold.runtime.slowdown import ENV as SLOW_ENV
from fivefold.runtime.slowdown import slow_down
from fivefold.spec import Plan

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class InjectedLoss:
    """The loss of the global batch the loader drew last, multiplied by the knob's factor for that batch
    (batches counted from 1 in the data order, so a skipped batch is never hit again)."""

    def __init__(self, loss_fn: LossFn, factors: dict[int, float], loader, global_batch: int) -> None:
        self.loss_fn, self.factors, self.loader, self.global_batch = loss_fn, factors, loader, global_batch

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, targets)
        factor = self.factors.get(self.loader.samples_seen // self.global_batch)
        return loss if factor is None else loss * factor


@dataclass(frozen=True)
class FaultKnobs:
    slow_devices: bool = False  # FIVEFOLD_SLOW_DEVICES is set
    loss_factors: dict[int, float] = field(default_factory=dict)  # global batch number -> factor on its loss
    hang_at: tuple[int, int] | None = None  # (rank, step) that hangs in the first incarnation

    @classmethod
    def from_env(cls) -> FaultKnobs:
        return cls(bool(os.environ.get(SLOW_ENV, "").strip()), injected_loss_factors(), hang_point())

    def stage_model(self, model: nn.Module, plan: Plan, rank: int) -> nn.Module:
        """Before parallelization: the slowdown of this rank's device, timed per block."""
        return slow_down(model, plan, rank) if self.slow_devices else model

    def loss(self, loss_fn: LossFn, loader, global_batch: int) -> LossFn:
        return InjectedLoss(loss_fn, self.loss_factors, loader, global_batch) if self.loss_factors else loss_fn

    def step_started(self, step: int, rank: int, restart: int) -> None:
        """The hang: this rank stops participating (its peers time out) at the start of the knob's step."""
        if self.hang_at is not None and restart == 0 and self.hang_at == (rank, step):
            while True:
                time.sleep(3600)


NO_KNOBS = FaultKnobs()
