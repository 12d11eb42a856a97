"""`fivefold train --profile-steps A-B`: torch.profiler over steps A to B on every rank, and on CUDA the
caching allocator's memory history over the same steps.

    RUN/profile/rank<R>-steps<A>-<B>.trace.json      Chrome trace JSON: open it in https://ui.perfetto.dev or
                                                     chrome://tracing (CPU ops with their input shapes, CUDA
                                                     kernels on a GPU)
    RUN/profile/rank<R>-steps<A>-<B>.memory.pickle   CUDA only: torch.cuda.memory._dump_snapshot, for
                                                     https://pytorch.org/memory_viz

The same pieces TorchTitan's profiling module uses (torch.profiler.profile, export_chrome_trace, the CUDA memory
snapshot API); here the window is given in steps of this run and each step is marked (ProfilerStep#N) in the
trace. A run stopped inside the window (SIGTERM) writes what it profiled. `fivefold report RUN` lists the files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fivefold.report.load import PROFILE_DIR
from fivefold.spec.job import parse_profile_steps

MEMORY_HISTORY_ENTRIES = 100_000  # allocation events kept for the snapshot (PyTorch's documented example)


class StepProfiler:
    """Starts at the beginning of step A, marks each step, writes this rank's files after step B."""

    def __init__(self, profile_steps: str | None, steps: int, run_dir: str | None, rank: int,
                 device: torch.device) -> None:
        self.window = parse_profile_steps(profile_steps, steps) if profile_steps else None
        self.rank, self.device = rank, device
        self.folder = Path(run_dir or ".") / PROFILE_DIR
        self.profiler: torch.profiler.profile | None = None

    def begin_step(self, step: int) -> None:
        if self.window is None or step != self.window[0] or self.profiler is not None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        # A schedule that always records: torch marks steps (ProfilerStep#N) only when given one.
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True,
                                               schedule=lambda _: torch.profiler.ProfilerAction.RECORD)
        self.profiler.step_num = step  # its step markers carry this run's step numbers
        self.profiler.__enter__()

    def end_step(self, step: int) -> None:
        if self.profiler is None:
            return
        assert self.window is not None
        if step >= self.window[1]:
            self.finish()
        else:
            self.profiler.step()  # closes ProfilerStep#<step> in the trace, opens the next

    def finish(self) -> None:
        """Stop and write this rank's files (after step B, or when the run stops inside the window)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        assert self.window is not None
        stem = self.folder / f"rank{self.rank}-steps{self.window[0]}-{self.window[1]}"
        profiler.export_chrome_trace(str(stem.with_suffix(".trace.json")))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(stem.with_suffix(".memory.pickle")))
            torch.cuda.memory._record_memory_history(enabled=None)
