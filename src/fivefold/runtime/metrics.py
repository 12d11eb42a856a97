"""What one step measured: the JSON line in the metrics file, the progress bar, MFU and peak memory."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch

from fivefold.spec import Plan
from fivefold.spec.units import GIB

METRIC_FIELDS = ("step", "loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s", "mfu",
                 "peak_memory_gib")
# For `fivefold report`: per-rank lists (index = global rank) of each rank's peak memory and its own step
# time, from its step start until its optimizer step is done (before the loss and these are gathered);
# and first_step, the first step this launch ran (> 1 after a resume), where its warm-up begins.
PER_RANK_FIELDS = ("peak_memory_gib_per_rank", "step_time_s_per_rank")


def peak_flops(plan: Plan, dtype: str) -> float:
    """Summed peak FLOP/s of the plan's devices (its cluster and placement) for the dtype computed in."""
    cluster = plan.cluster
    return sum(cluster.group_of(device).device.flops(dtype) for device in plan.placement)


def peak_memory_gib(device: torch.device) -> float:
    """Peak device memory of this process: allocated CUDA memory since the last reset on a GPU, the
    process's peak resident set (ru_maxrss, includes the Python interpreter and torch) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux reports KiB


def seconds_since(start: float, device: torch.device) -> float:
    """perf_counter seconds since `start`, once this rank's queued GPU work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def gather_from_ranks(values: list[float], device: torch.device, rank: int) -> list[list[float]]:
    """Every rank's `values`, indexed by plan rank (`rank`: this worker's), on every rank. One all-reduce
    (sum) of a [world, len(values)] table in which each rank fills its own row: it replaces the all-reduce of
    the peak memory the loop did before, at about its cost (gloo, 2 ranks: 0.44 ms against 0.36 ms; an
    all_gather took 0.76 ms)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(values)]
    table = torch.zeros(dist.get_world_size(), len(values), dtype=torch.float64, device=device)
    table[rank] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(table)
    return table.tolist()


class MetricsFile:
    """Appends one JSON object per line; flushed every step so a crashed run keeps its history. Also where
    the step's scalars go to TensorBoard (--tensorboard) and W&B (--wandb), and the last finished step to the launcher's
    progress file (read when the run is interrupted, for the "interrupted at step N" line)."""

    def __init__(self, path: str | None, tensorboard: str | None = None, progress_file: str | None = None,
                 wandb: Any = None) -> None:
        self.file: IO[str] | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a")
        self.tensorboard = None
        if tensorboard:
            from fivefold.runtime.tensorboard import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(tensorboard)
        self.wandb = wandb  # a runtime/tracking.py WandbWriter (--wandb), or None
        self.progress_file = progress_file

    @classmethod
    def for_run(cls, config: Any, is_rank0: bool) -> MetricsFile:
        """Rank 0 writes everything; the other ranks get a sink that writes nothing."""
        if not is_rank0:
            return cls(None)
        wandb = None
        if getattr(config, "wandb", None):
            from fivefold.runtime.tracking import WandbWriter

            wandb = WandbWriter(config.wandb, config.run_dir, config)
        return cls(config.metrics_file, config.tensorboard, getattr(config, "progress_file", None), wandb)

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if self.wandb is not None:
            self.wandb.write(record)
        if self.progress_file:
            Path(self.progress_file).write_text(f"{record['step']}\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()


def format_step(record: dict[str, Any]) -> str:
    evaluated = (f"  eval_loss {record['eval_loss']:.4f}  eval_ppl {record['eval_perplexity']:.2f}"
                 if "eval_loss" in record else "")
    return (f"loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  lr {record['lr']:.2e}  "
            f"{record['tokens_per_s']:,.0f} tok/s  mfu {100 * record['mfu']:.2f}%  "
            f"mem {record['peak_memory_gib']:.2f} GiB  {record['step_time_s'] * 1e3:.1f} ms/step" + evaluated)


class Progress:
    """A rich progress bar on a terminal, one plain line per step otherwise (logs, pipes, tests)."""

    def __init__(self, total_steps: int, title: str, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stdout
        self.total = total_steps
        self.bar = None
        print(title, file=self.stream, flush=True)
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=20),
                                    MofNCompleteColumn(), TimeRemainingColumn(), TextColumn("{task.fields[figures]}"),
                                    console=Console(file=self.stream))
            self.task = self.bar.add_task("step", total=total_steps, figures="")
            self.bar.start()

    def update(self, record: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=record["step"], figures=format_step(record))
        else:
            print(f"step {record['step']}/{self.total}  {format_step(record)}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class StepMeter:
    """Times one step and builds its metrics record: loss, throughput, MFU, the busiest rank's memory, and the
    per-rank lists `fivefold report` and the straggler watch read (one gather over the ranks, on the steps
    runtime/bookkeeping.py picks)."""

    def __init__(self, plan: Plan, device: torch.device, rank: int, compute_dtype: str, first_step: int) -> None:
        from fivefold.cost.flops import model_flops_per_step

        self.plan, self.device, self.rank, self.first_step = plan, device, rank, first_step
        self.flops_per_step = model_flops_per_step(plan.model, plan.train)
        # MFU = model FLOPs per step / (step time x summed peak FLOP/s of the dtype actually computed in).
        self.total_peak_flops = peak_flops(plan, compute_dtype)
        self.tokens = first_step * plan.train.tokens_per_step
        self.started = 0.0
        self.memory = 0.0  # the busiest rank's peak memory at the last gather

    def start(self) -> None:
        self.started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def finish(self, step: int, loss: float, grad_norm: float, lr: float, skipped: bool, forward_s: float,
               extra: dict[str, Any] | None = None, gather: bool = True) -> dict[str, Any]:
        """The record of `step` (1-based), once this rank's optimizer step is done. `gather`: this step
        gathers the per-rank lists (runtime/bookkeeping.py gathers_metrics); other steps carry none, and
        their peak memory is the busiest rank's at the last gather, or this rank's own if higher."""
        own_step_time = seconds_since(self.started, self.device)  # this rank's step, before the gather below
        per_rank: dict[str, Any] = {}
        if gather:
            memory_per_rank, time_per_rank, forward_per_rank = zip(*gather_from_ranks(
                [peak_memory_gib(self.device), own_step_time, forward_s], self.device, self.rank))
            self.memory = max(memory_per_rank)  # the busiest rank's memory is the one that must fit
            per_rank = {"peak_memory_gib_per_rank": list(memory_per_rank), "step_time_s_per_rank": list(time_per_rank),
                        "forward_time_s_per_rank": list(forward_per_rank)}
        else:
            self.memory = max(self.memory, peak_memory_gib(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_time = time.perf_counter() - self.started
        tokens_per_step = self.plan.train.tokens_per_step
        self.tokens += tokens_per_step
        return {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": self.tokens,
                "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
                "mfu": self.flops_per_step / (step_time * self.total_peak_flops),
                "peak_memory_gib": self.memory, **per_rank, "first_step": self.first_step + 1,
                "skipped": skipped, "wall_time": time.time(), **(extra or {})}


def summarize(plan: Plan, device: torch.device, history: list[dict], metrics_file: str | None) -> dict:
    """Rank 0's account of the run; step times leave out the first step (warm-up, lazy init)."""
    timed = history[1:] or history
    mean_time = sum(r["step_time_s"] for r in timed) / max(1, len(timed))
    return {
        "plan": plan.describe(), "world_size": plan.world_size, "device": device.type, "steps": len(history),
        "losses": [r["loss"] for r in history], "grad_norms": [r["grad_norm"] for r in history],
        "final_loss": history[-1]["loss"] if history else None,
        "mean_step_time_s": mean_time,
        "tokens_per_s": plan.train.tokens_per_step / mean_time if mean_time else 0.0,
        "mfu": sum(r["mfu"] for r in timed) / max(1, len(timed)),
        "peak_memory_gib": max((r["peak_memory_gib"] for r in history), default=0.0),
        "metrics_file": metrics_file,
    }
