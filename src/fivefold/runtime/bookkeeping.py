"""Per-step bookkeeping in at most one small collective besides the gradient sync.

Every step, one all-reduce over the whole world of a float64 vector carries what each rank must agree on:
  [0] its share of the squared gradient norm (runtime/optim.py local_grad_norm_squared),
  [1] its share of the loss: the last pipeline stage of each data-parallel replica holds its rows' loss,
      once per tp group (tp ranks hold the same loss: only tp rank 0 adds it), every other rank adds 0,
  [2] rank 0's request for per-rank metrics this step (its straggler watch is following a slow rank),
  [3] whether this rank was asked to stop (SIGTERM; runtime/preemption.py): every rank then stops after this
      step, together, as Megatron-LM's exit signal handler does with a collective of its own.
With DiLoCo (G outer groups, runtime/diloco.py) slot [0] becomes G slots, one per group, and each group
clips by its own norm; the loss is then the mean of the groups' losses, the guard's norm the root mean square.
The loss guard needs no collective of its own: every rank judges the same global loss and gradient norm
with the same history, so every rank reaches the same verdict.

Per-rank metrics (peak memory, own step time, forward time) need a second collective, a [world, 3] table
(runtime/metrics.py gather_from_ranks). It runs every `metrics_every` steps, on the first and last step of
the run, on a step the guard judged bad, and while the straggler watch follows a slow rank (so its
"N steps in a row" still counts consecutive steps); not on the other steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivefold.spec import Plan


@dataclass(frozen=True)
class StepTotals:
    """What every rank knows after the step's one bookkeeping all-reduce."""

    grad_norm: float  # global gradient norm before clipping
    loss: float  # global loss of the step
    metrics_requested: bool  # rank 0 asked for per-rank metrics this step
    group_grad_norm: float = math.nan  # DiLoCo: this rank's outer group's norm (what it clips by)
    stop_requested: bool = False  # some rank got SIGTERM: every rank stops after this step


def reduce_step_totals(grad_norm_squared: torch.Tensor, local_loss: torch.Tensor, plan: Plan, tp_rank: int,
                       request_metrics: bool, outer_groups: int = 1, outer_index: int = 0,
                       stop: bool = False) -> StepTotals:
    """The one all-reduce of the step (module docstring). `request_metrics` counts from rank 0 only; `stop`
    from any rank."""
    holds_loss = tp_rank == 0
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    slots = torch.zeros(outer_groups, dtype=torch.float64, device=grad_norm_squared.device)
    slots[outer_index] = grad_norm_squared.to(torch.float64)
    values = torch.cat([slots, torch.stack([
                          local_loss.detach().to(torch.float64) if holds_loss else
                          torch.zeros((), dtype=torch.float64, device=grad_norm_squared.device),
                          torch.tensor(float(request_metrics and is_rank0), dtype=torch.float64,
                                       device=grad_norm_squared.device),
                          torch.tensor(float(stop), dtype=torch.float64, device=grad_norm_squared.device)])])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    *squares, loss, requested, stops = values.tolist()
    squared = sum(squares) / outer_groups

    def root(value: float) -> float:
        return math.sqrt(value) if value >= 0 else math.nan
    return StepTotals(root(squared), loss / outer_groups, requested > 0, root(squares[outer_index]), stops > 0)


def gathers_metrics(step: int, first_step: int, last_step: int, every: int, bad_step: bool,
                    requested: bool) -> bool:
    """Whether 1-based step `step` gathers the per-rank metrics (module docstring); the same on every rank."""
    return (step == first_step or step == last_step or bad_step or requested
            or (every > 0 and step % every == 0))
