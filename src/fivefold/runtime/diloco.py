"""DiLoCo and Streaming DiLoCo across the outer groups of the data-parallel dimension, and the bytes each
rank sends for data-parallel synchronisation.

The dp dimension is cut into outer groups (spec/diloco.py); the mesh gets an "outer" dim in front of dp
(runtime/mesh.py), so every inner layout (DDP, ZeRO/FSDP, tp, pp, cp) reduces its gradients inside its own
group exactly as without DiLoCo. After inner step s, fragment p whose turn it is (spec/diloco.sends_at)
starts an asynchronous all-reduce over the "outer" mesh dim of its outer gradient (outer weights - local
weights, in --outer-dtype); `overlap` steps later it is averaged, the outer SGD step with Nesterov momentum
moves the outer weights, and the local weights of the fragment become the new outer weights (torchft's
default mixing alpha = 0). Every rank holds the outer weights and momentum of its own local shards only.

Written here rather than taken from torchft: torchft.local_sgd.DiLoCo takes a torchft Manager, whose
quorum comes from the lighthouse service and whose all-reduce runs on the Manager's own replica process
group; fivefold's outer replicas are a dim of the plan's DeviceMesh, and its runs have no lighthouse.
The algorithm follows torchft's (fragments, sync delay, Nesterov outer SGD) and the Streaming DiLoCo paper.

Checkpoints (runtime/checkpointing.py): the outer weights and momentum are saved as tensors of the same
kind as the parameters (DTensors under FSDP/tp), so DCP reshards them under another inner plan; the local
weights and AdamW state of group g > 0 are saved under keys of their own ("model_g1", ...), group 0's under
the usual "model"/"optimizer". An exchange in flight at a save is completed and applied first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fivefold.spec import Plan
from fivefold.spec.diloco import DiLoCoSpec, applies_at, sends_at

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def local_of(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of `param` (its storage: writing it writes the parameter)."""
    return param.to_local() if isinstance(param, DTensor) else param.data


def ring_bytes(size_bytes: float, ranks: int, passes: float) -> float:
    """Bytes one rank sends in `passes` ring reduce-scatters or all-gathers of a `size_bytes` buffer
    (an all-reduce is 2 passes): (n-1)/n of the buffer per pass."""
    return passes * size_bytes * (ranks - 1) / ranks if ranks > 1 else 0.0


def inner_sync_bytes(plan: Plan, params: list[nn.Parameter], groups: int, micro_batches: int) -> float:
    """Bytes this rank sends per step reducing gradients (and gathering ZeRO weights) inside its outer group,
    counted by the ring rule: zero 0 and 1 all-reduce (or reduce-scatter + all-gather) once a step; zero 2
    reduce-scatters and gathers every micro-batch; zero 3 gathers twice (forward, backward) and reduce-scatters
    every micro-batch. The buffer is this rank's share of the replica (tp/pp shards, whole over dp)."""
    ranks = plan.dp // groups * plan.cp
    replica = 0.0
    for param in params:
        local = local_of(param)
        sharded_over_dp = isinstance(param, DTensor) and any(
            ("dp" in name.split("_")) and not placement.is_replicate()
            for name, placement in zip(param.device_mesh.mesh_dim_names or (), param.placements))
        replica += local.numel() * local.element_size() * (ranks if sharded_over_dp else 1)
    passes = {0: 2.0, 1: 2.0, 2: 2.0 * micro_batches, 3: 3.0 * micro_batches}[plan.zero]
    return ring_bytes(replica, ranks, passes)


class OuterLoop:
    """The outer weights, momentum and in-flight exchanges of this rank's local shards (module docstring)."""

    def __init__(self, spec: DiLoCoSpec, named_params: list[tuple[str, nn.Parameter]],
                 group: dist.ProcessGroup | None, group_index: int) -> None:
        self.spec = spec
        self.group = group  # this rank and its counterparts in the other outer groups
        self.group_index = group_index
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.locals = [local_of(p) for p in self.params]
        self.outer = [t.detach().clone().float() for t in self.locals]
        self.momentum = [torch.zeros_like(t) for t in self.outer]
        self.fragments = self.cut_fragments(spec.fragments)
        self.pending: dict[int, tuple[dist.Work | None, torch.Tensor, int]] = {}  # fragment -> (work, buffer, step)

    def cut_fragments(self, count: int) -> list[list[int]]:
        """Consecutive parameters in `count` pieces of about equal size (model order: embeddings, blocks, head)."""
        sizes = [t.numel() for t in self.locals]
        total, pieces, running = sum(sizes), [[] for _ in range(count)], 0
        for index, size in enumerate(sizes):
            pieces[min(count - 1, running * count // max(1, total))].append(index)
            running += size
        return pieces

    def fragment_bytes(self, fragment: int) -> int:
        return sum(self.locals[i].numel() for i in self.fragments[fragment]) * self.spec.outer_bytes_per_element

    @torch.no_grad()
    def send(self, fragment: int, step: int) -> float:
        """Start the exchange of `fragment`'s outer gradient; the bytes this rank sends for it."""
        dtype = DTYPES[self.spec.outer_dtype]
        buffer = torch.cat([(self.outer[i] - self.locals[i].float()).flatten() for i in self.fragments[fragment]]
                           ).to(dtype)
        groups = self.spec.groups
        work = dist.all_reduce(buffer, group=self.group, async_op=True) if groups > 1 else None
        self.pending[fragment] = (work, buffer, step)
        return ring_bytes(buffer.numel() * buffer.element_size(), groups, 2)

    @torch.no_grad()
    def apply(self, fragment: int) -> None:
        """Finish `fragment`'s exchange: outer Nesterov SGD on the mean outer gradient; local = outer."""
        work, buffer, _ = self.pending.pop(fragment)
        if work is not None:
            work.wait()
        mean = buffer.float() / self.spec.groups
        lr, mu = self.spec.outer_lr, self.spec.outer_momentum
        offset = 0
        for i in self.fragments[fragment]:
            size = self.outer[i].numel()
            grad = mean[offset:offset + size].view_as(self.outer[i])
            offset += size
            self.momentum[i].mul_(mu).add_(grad)
            self.outer[i].sub_(grad.add(self.momentum[i], alpha=mu), alpha=lr)  # Nesterov: g + mu * m
            self.locals[i].copy_(self.outer[i])

    def after_step(self, step: int) -> dict:
        """Called after inner step `step` (1-based) on every rank: send and apply what the schedule says.
        The metrics of the step: outer bytes sent, fragments sent and applied."""
        sent = sends_at(step, self.spec)
        outer_bytes = sum(self.send(p, step) for p in sent)
        applied = applies_at(step, self.spec)
        for p in applied:
            self.apply(p)
        out: dict = {"outer_sync_bytes": outer_bytes}
        if sent:
            out["outer_sent"] = sent
        if applied:
            out["outer_applied"] = applied
            out["outer_weights_spread"] = self.spread(applied)
        return out

    @torch.no_grad()
    def spread(self, fragments: list[int]) -> float:
        """Largest difference between outer groups of a checksum of the just-synced local weights (0: every
        group holds identical weights); one tiny all-gather over the outer groups."""
        sums = torch.zeros(1, dtype=torch.float64)
        for p in fragments:
            for i in self.fragments[p]:
                t = self.locals[i].double().flatten()
                sums += (t * torch.arange(1, t.numel() + 1, dtype=torch.float64)).sum()
        if self.spec.groups == 1:
            return 0.0
        gathered = [torch.zeros_like(sums) for _ in range(self.spec.groups)]
        dist.all_gather(gathered, sums, group=self.group)
        values = torch.cat(gathered)
        return float(values.max() - values.min())

    def flush(self) -> None:
        """Apply every exchange in flight now (before a save or at the end of the run)."""
        for fragment in sorted(self.pending):
            self.apply(fragment)

    # --- checkpoint -------------------------------------------------------------------------------
    def as_param_kind(self, tensor: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        if isinstance(param, DTensor):
            return DTensor.from_local(tensor, param.device_mesh, param.placements, shape=param.shape,
                                      stride=param.stride(), run_check=False)
        return tensor

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Outer weights and momentum keyed by parameter FQN, in the parameters' sharding (identical in every
        outer group, so DCP keeps one copy)."""
        self.flush()
        state = {}
        for name, param, outer, momentum in zip(self.names, self.params, self.outer, self.momentum):
            state[f"outer.{name}"] = self.as_param_kind(outer, param)
            state[f"momentum.{name}"] = self.as_param_kind(momentum, param)
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for work, _, _ in self.pending.values():  # a rollback: exchanges of abandoned steps are void
            if work is not None:
                work.wait()
        self.pending.clear()
        for i, name in enumerate(self.names):
            for key, target in ((f"outer.{name}", self.outer[i]), (f"momentum.{name}", self.momentum[i])):
                value = state[key]
                target.copy_(value.to_local() if isinstance(value, DTensor) else value)

    @torch.no_grad()
    def reset_to_local(self) -> None:
        """Outer weights = the local weights, momentum zero (the state of a run that starts here)."""
        for local, outer, momentum in zip(self.locals, self.outer, self.momentum):
            outer.copy_(local)
            momentum.zero_()

    def group_key(self, key: str) -> str:
        """Where this outer group's local weights and optimizer live in a checkpoint."""
        return key if self.group_index == 0 else f"{key}_g{self.group_index}"
