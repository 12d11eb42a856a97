"""AdamW, the learning-rate schedule, and gradient clipping by the true global norm.

The same on every plan: what differs between plans is only where each shard of a gradient lives, and
clip_grad_norm_ below adds the squares of every shard exactly once over the whole world.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from fivefold.runtime.schedule import lr_at
from fivefold.spec import MESH_DIMS, Plan

__all__ = ["build_optimizer", "clip_grad_norm_", "clip_to_norm", "local_grad_norm_squared", "lr_at", "set_lr"]

BETAS = (0.9, 0.95)  # GPT-3 / Llama
WEIGHT_DECAY = 0.1


def build_optimizer(params: list[nn.Parameter], lr: float, weight_decay: float = WEIGHT_DECAY,
                    betas: tuple[float, float] = BETAS, eps: float = 1e-8) -> torch.optim.AdamW:
    """Weight decay on matrices (ndim >= 2: linear weights and embeddings), none on norms and biases
    (nanoGPT's rule)."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _replicas(plan: Plan, sharded_dims: set[str], outer_groups: int = 1) -> int:
    """How many ranks hold an identical copy of a tensor sharded over `sharded_dims`: every mesh dim
    except pp (stages own disjoint weights) that does not shard it holds a replica."""
    count = 1
    for dim in MESH_DIMS:
        if dim != "pp" and dim not in sharded_dims:
            count *= getattr(plan, dim) // (outer_groups if dim == "dp" else 1)  # DiLoCo: inside one group
    # Experts live on the (pp, edp, ep, etp) view of the same world (spec/folding.py): edp x ep x etp are
    # the tp x cp x dp ranks of a stage, and a slice is replicated over the expert dims that do not split it.
    expert_dims = {"edp", "ep", "etp"}
    if sharded_dims & expert_dims:
        count = plan.tp * plan.cp * plan.dp
        for dim in expert_dims & sharded_dims:
            count //= getattr(plan, dim)
    return count


@torch.no_grad()
def local_grad_norm_squared(params: list[nn.Parameter], plan: Plan, outer_groups: int = 1) -> torch.Tensor:
    """This rank's share of the squared global gradient norm (float64 scalar): the squares of the gradient
    elements it holds, weighted by 1/replicas so that a tensor replicated over dp/tp/cp counts once. Summed
    over the world (every stage, every shard) it is the square of the global norm; with DiLoCo's
    `outer_groups`, summed over one outer group it is that group's. Same idea as TorchTitan's
    dist_utils.clip_grad_norm_, which adds the pp all-reduce on top of DTensor's norm."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(isinstance(pl, Partial) for pl in grad.placements):
            # A sequence-parallel norm's weight: its gradient is still a sum over the tp ranks.
            param.grad = grad.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl
                                                       for pl in grad.placements])
    locals_by_replicas: dict[int, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            names = grad.device_mesh.mesh_dim_names or ()
            # Shard and FSDP2+TP's _StridedShard (not a Shard subclass) both split the tensor.
            sharded = {names[i] for i, pl in enumerate(grad.placements) if not pl.is_replicate()}
            sharded |= {dim for name in sharded for dim in name.split("_")}  # FSDP's flattened "dp_cp" mesh
            local = grad.to_local()
        else:
            sharded, local = set(), grad
        locals_by_replicas.setdefault(_replicas(plan, sharded, outer_groups), []).append(local)
    device = next((t.device for group in locals_by_replicas.values() for t in group), torch.device("cpu"))
    total_sq = torch.zeros((), dtype=torch.float64, device=device)
    for replicas, group in locals_by_replicas.items():
        norms = torch.stack(torch._foreach_norm(group)).double()  # one fused pass, as torch's clip does
        total_sq += norms.pow(2).sum() / replicas
    return total_sq


@torch.no_grad()
def clip_to_norm(params: list[nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scale the gradients this rank holds so that their global norm `total_norm` becomes at most `max_norm`."""
    clip = max_norm / (total_norm + 1e-6)
    if clip < 1.0:
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, clip)  # the local shards are the DTensors' storage


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, plan: Plan) -> float:
    """Scale gradients so their global L2 norm is at most `max_norm`; return the norm before clipping.
    One all-reduce of the local squares over the world (the training loop sends them together with the
    loss instead: runtime/bookkeeping.py)."""
    total_sq = local_grad_norm_squared(params, plan)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total_sq)
    total_norm = math.sqrt(total_sq.item())
    clip_to_norm(params, max_norm, total_norm)
    return total_norm
