"""Executors run a StepBatch on one replica and hand back (replica, step number, logits of the sampled rows).

LocalExecutor runs it in this process (tp1, pp1, one replica: `generate` without worker processes);
workers.py's WorkerPool runs every other layout on worker processes."""

from __future__ import annotations

import torch

from fivefold.serve.batch import StepBatch
from fivefold.serve.runner import build_runner
from fivefold.serve.source import ModelSource
from fivefold.spec.serve import ServeLayout


class LocalExecutor:
    def __init__(self, source: ModelSource, layout: ServeLayout, device: str = "cpu", memory_window: int = 0) -> None:
        self.runner = build_runner(source, layout, device=device, memory_window=memory_window)
        self._done: list[tuple[int, int, torch.Tensor]] = []

    def submit(self, batch: StepBatch) -> None:
        self._done.append((batch.replica, batch.number, self.runner.forward(batch)))

    def poll(self, wait: float) -> list[tuple[int, int, torch.Tensor]]:
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        self.runner.close()


def make_executor(source: ModelSource, layout: ServeLayout, device: str = "cpu", memory_window: int = 0,
                  torchrun: bool = False):
    """In this process when one rank holds the whole model, else worker processes; under torchrun, the world's
    ranks (torchrun.py: None on every rank but 0, after rank 0 has stopped them)."""
    if torchrun:
        from fivefold.serve.torchrun import torchrun_executor

        return torchrun_executor(source, layout, device, memory_window)
    if layout.devices == 1:
        return LocalExecutor(source, layout, device, memory_window)
    from fivefold.serve.workers import WorkerPool

    return WorkerPool(source, layout, device, memory_window)
