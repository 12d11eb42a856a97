"""The loss guard: a step whose loss or gradient norm is NaN/Inf, or whose loss jumps above
`max_loss_spike` x the running median of recent good losses, does not update the weights; after
`max_bad_steps` bad steps in a row the run rolls back to its newest checkpoint and skips the batches
that were bad (by their position in the data, `samples_seen` at the batch's start, which is the same
under every plan).

Lockstep: every rank sees the same global loss and gradient norm (both are all-reduced), but the
decision is all-reduced too (train.py), so a last-bit difference can never split the ranks.

Test-only knob (fault injection):

    FIVEFOLD_INJECT_LOSS="3:nan,4:inf,7:x50"

multiplies the loss of the 3rd global batch of the data order by NaN, of the 4th by Inf, of the 7th by
50 (a spike; gradients scale with it). Batches, not steps: after a rollback the step numbers repeat but
a skipped batch is never drawn again, as with real bad data. No torch import.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from dataclasses import dataclass, field

from fivefold.errors import SpecError

INJECT_ENV = "FIVEFOLD_INJECT_LOSS"
SPIKE_WINDOW = 8  # good losses the running median is taken over
SPIKE_WARMUP = 3  # good losses needed before spikes are judged (the first steps fall fast)


def injected_loss_factors(text: str | None = None) -> dict[int, float]:
    """'3:nan,7:x50' -> {3: nan, 7: 50.0}: batch number (1-based) -> factor on its loss."""
    text = os.environ.get(INJECT_ENV, "") if text is None else text
    factors: dict[int, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        batch, sep, what = item.partition(":")
        try:
            number = int(batch)
            factor = float(what[1:]) if what.startswith("x") else float(what)
        except ValueError:
            number, factor = 0, 0.0
        if not sep or number < 1 or not (math.isnan(factor) or math.isinf(factor) or what.startswith("x")):
            raise SpecError(INJECT_ENV, text, "write BATCH:nan, BATCH:inf or BATCH:xFACTOR items separated by "
                                              "commas, e.g. 3:nan,7:x50 (batch numbers from 1)")
        factors[number] = factor
    return factors


@dataclass
class Verdict:
    bad: bool
    reason: str  # "" when good


@dataclass
class LossGuard:
    """Judges each step; counts bad steps in a row and remembers the bad batches' positions."""

    max_loss_spike: float = 3.0  # a loss above this x the running median is a spike; 0 disables
    max_bad_steps: int = 3  # bad steps in a row before rolling back to the last checkpoint; 0 = never
    recent: deque = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))
    bad_in_a_row: int = 0
    bad_positions: set[int] = field(default_factory=set)  # samples_seen at the start of each bad batch
    pending: list[int] = field(default_factory=list)  # bad positions since the last good step

    def judge(self, loss: float, grad_norm: float) -> Verdict:
        if not math.isfinite(loss):
            return Verdict(True, f"loss is {loss}")
        if not math.isfinite(grad_norm):
            return Verdict(True, f"gradient norm is {grad_norm}")
        if self.max_loss_spike > 0 and len(self.recent) >= SPIKE_WARMUP:
            median = statistics.median(self.recent)
            if loss > self.max_loss_spike * median:
                return Verdict(True, f"loss {loss:.4g} is {loss / median:.1f}x the running median {median:.4g} "
                                     f"(limit {self.max_loss_spike:g}x)")
        return Verdict(False, "")

    def record(self, verdict: Verdict, loss: float, position: int) -> None:
        """After all ranks agreed on `verdict` for the batch that started at sample `position`."""
        if verdict.bad:
            self.bad_in_a_row += 1
            self.bad_positions.add(position)
            self.pending.append(position)
        else:
            self.bad_in_a_row = 0
            self.pending.clear()
            self.recent.append(loss)

    @property
    def should_roll_back(self) -> bool:
        return self.max_bad_steps > 0 and self.bad_in_a_row >= self.max_bad_steps

    def rolled_back(self) -> None:
        self.bad_in_a_row = 0
        self.pending.clear()


def check_guard_flags(max_loss_spike: float, max_bad_steps: int) -> None:
    if not (max_loss_spike == 0 or max_loss_spike > 1):
        raise SpecError("--max-loss-spike", max_loss_spike, "must be above 1 (a factor over the running median "
                                                            "loss), or 0 to disable spike detection")
    if max_bad_steps < 0:
        raise SpecError("--max-bad-steps", max_bad_steps, "must be 0 (never roll back) or a positive count")
