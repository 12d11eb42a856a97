"""Stragglers: a rank whose compute is persistently slower than the others'.

What is compared: each rank's forward compute time per step, from the first module's forward to the
last one's, summed over its micro-batches (`ForwardClock`). Not the whole step time: in synchronous
training the fast ranks wait for the slow one inside the step (gradient all-reduce, pipeline receives),
so every rank's step time ends up the slow rank's and the straggler hides. Forward passes of a stage
wait for nobody between its first and last module (data parallel reduces in backward; pipeline
receives happen outside the stage), so the slow rank stands out there. Tensor parallel's all-reduces
inside a block are waits too; a slow rank then shows up less clearly.

The reference is the low median of the ranks' times (statistics.median_low): with 2 ranks the plain
median is the mean, which a rank 2x slower exceeds by only 1.33x.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


@dataclass
class StragglerWatch:
    """Flags a rank slower than `factor` x the median for `patience` consecutive steps (once per rank)."""

    factor: float = 1.5  # 0 disables
    patience: int = 3
    hosts: list[str] = field(default_factory=list)  # hostname of each global rank
    slow_since: dict[int, int] = field(default_factory=dict)  # rank -> first step of its current slow streak
    ratios: dict[int, list[float]] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)

    def observe(self, step: int, seconds_per_rank: list[float]) -> list[dict]:
        """Call once per step with every rank's time; returns the stragglers found at this step."""
        if self.factor <= 0 or len(seconds_per_rank) < 2:
            return []
        median = statistics.median_low(seconds_per_rank)
        found = []
        for rank, seconds in enumerate(seconds_per_rank):
            ratio = seconds / median if median > 0 else 1.0
            if ratio <= self.factor:
                self.slow_since.pop(rank, None)
                self.ratios.pop(rank, None)
                continue
            self.slow_since.setdefault(rank, step)
            self.ratios.setdefault(rank, []).append(ratio)
            streak = step - self.slow_since[rank] + 1
            if streak >= self.patience and rank not in self.reported:
                self.reported.add(rank)
                found.append({"rank": rank, "host": self.hosts[rank] if rank < len(self.hosts) else "?",
                              "since_step": self.slow_since[rank], "steps": streak,
                              "ratio": statistics.median(self.ratios[rank]), "factor": self.factor})
        return found


def describe_straggler(found: dict) -> str:
    return (f"straggler: rank {found['rank']} on host {found['host']} computes {found['ratio']:.1f}x slower "
            f"than the median rank for {found['steps']} steps in a row (since step {found['since_step']}; "
            f"limit {found['factor']:g}x)")


class ForwardClock:
    """Sums the wall time of this rank's stage forwards (first module's start to last module's end) in
    the current step. On CUDA it records events, read once at the end of the step (no extra syncs)."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.open: float | None = None
        self.pairs: list = []

    def attach(self, model) -> None:
        modules = [*model.layers.values(), *(m for m in (getattr(model, "norm", None), getattr(model, "output", None))
                                             if m is not None)]
        if modules:
            import torch

            # Left out of a compiled block's graph (`train --compile`): the clock reads time.perf_counter.
            modules[0].register_forward_pre_hook(torch.compiler.disable(lambda module, args: self.start()))
            modules[-1].register_forward_hook(torch.compiler.disable(lambda module, args, output: self.stop()))

    def start(self) -> None:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.open = event
        else:
            self.open = time.perf_counter()

    def stop(self) -> None:
        if self.open is None:
            return
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pairs.append((self.open, event))
        else:
            self.seconds += time.perf_counter() - self.open
        self.open = None

    def take(self) -> float:
        """This step's forward seconds (call after the step's work is done); resets for the next step."""
        if self.cuda:
            self.seconds = sum(start.elapsed_time(end) for start, end in self.pairs) / 1e3
            self.pairs = []
        seconds, self.seconds = self.seconds, 0.0
        return seconds
