"""The hand-written PyTorch scripts bench/overhead.py compares `fivefold train` with, one per parallelism.

Each is what a user would write with torch's own pieces, on fivefold's model code (fivefold.models), seeded
weights and batches, AdamW with the same groups and a cosine schedule of the same shape (so both sides train
the same thing and their losses can be compared step by step):

    1 process  forward, cross-entropy, backward, clip_grad_norm_, AdamW (nanoGPT style)
    dp2        DistributedDataParallel, each rank its half of the batch
    zero3      fully_shard on every block and the root (FSDP2), SUM reductions (gloo has no AVG)
    tp2        parallelize_module: q/k/v and w1/w3 column-wise, wo and w2 row-wise, the embedding by
               vocabulary rows, the head column-wise (fivefold's plan without sequence parallel)
    pp2        torch.distributed.pipelining: two stages, Schedule1F1B, clipping by the norm summed over both
               stages (as TorchTitan does)
    cp2        context parallel by hand: torch 2.13's experimental context_parallel needs CUDA flash kernels,
               so each rank keeps one contiguous half of every row's sequence, all-gathers K and V (one
               collective for both) in a tiny autograd Function whose backward reduce-scatters their gradients
               (torch.distributed.nn.functional.all_gather's gloo backward emulates the reduce-scatter with
               world-size scatters, slower), and calls scaled_dot_product_attention with a causal mask from
               global positions; DDP sums the rest. Contiguous, not load-balanced, sharding: it is what a user
               writes first, and on CPU scaled_dot_product_attention with an explicit mask computes every
               (query, key) pair, so causal skipping, the reason to balance, does not exist on this path.
    ep2        expert parallel by hand: each rank keeps experts/2 of every MoE layer's experts as plain
               tensors, routes its token copies with all_to_all_single (the per-expert counts first, then
               the rows with those splits; torch.distributed.nn.functional.all_to_all_single carries the
               gradients back), runs the model's own router/top-k/experts code; DDP averages the non-expert
               gradients with the expert weights left out, and the expert gradients, which already hold every
               rank's tokens, are divided by the world size to match that average.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

LR = 1e-3


# --- tensor parallel -------------------------------------------------------------------------------

def tensor_parallel_by_hand(model: nn.Module, mesh) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                                     "output": ColwiseParallel(output_layouts=Replicate())})
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()})


def clip_tensor_parallel(params: list, max_norm: float) -> None:
    """clip_grad_norm_ refuses a mix of DTensor (sharded weights) and plain (norm weights) gradients: the
    sharded squares are summed over the tp ranks in one all-reduce, the replicated ones counted once. The
    placement that counts is the gradient's: the vocabulary-sharded embedding's gradient comes back
    Replicate (whole on every rank). The gradients are scaled in place (clip_grads_with_norm_ takes
    parameters, not gradients: given gradients it clips nothing)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    split = [isinstance(g, DTensor) and not all(pl.is_replicate() for pl in g.placements) for g in grads]
    sharded = [g.to_local() for g, s in zip(grads, split) if s]
    replicated = [g.to_local() if isinstance(g, DTensor) else g for g, s in zip(grads, split) if not s]
    squared = torch.stack(torch._foreach_norm(sharded)).pow(2).sum()
    dist.all_reduce(squared)
    squared += torch.stack(torch._foreach_norm(replicated)).pow(2).sum()
    torch._foreach_mul_(sharded + replicated, (max_norm / (squared.sqrt() + 1e-6)).clamp(max=1.0))


# --- context parallel ------------------------------------------------------------------------------

class GatherSequence(torch.autograd.Function):
    """[batch, s, ...] per rank -> [batch, world*s, ...] in rank order; backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.world = group, dist.get_world_size(group)
        out = x.new_empty(ctx.world * x.shape[0], *x.shape[1:])  # [world*batch, s, ...], rank-major
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out.unflatten(0, (ctx.world, -1)).transpose(0, 1).flatten(1, 2)  # [batch, world*s, ...]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        batch, full = grad.shape[:2]
        pieces = grad.reshape(batch, ctx.world, full // ctx.world, *grad.shape[2:]).transpose(0, 1)
        out = grad.new_empty(batch, full // ctx.world, *grad.shape[2:])
        dist.reduce_scatter_single(out, pieces.flatten(0, 1).contiguous(), group=ctx.group)
        return out, None


def context_parallel_by_hand(model: nn.Module, group) -> None:
    """Every attention layer attends its local queries to the whole sequence's keys and values."""
    from fivefold.models.attention import attend
    from fivefold.models.transformer import Attention

    def attention(q, k, v, positions, documents):
        kv = GatherSequence.apply(torch.cat([k, v], dim=-1), group)
        k_all, v_all = kv.split(k.shape[-1], dim=-1)
        keys = torch.arange(kv.shape[1], device=q.device)  # contiguous shards: gathered order is sequence order
        return attend(q, k_all, v_all, positions[:, None] >= keys[None, :])

    for module in model.modules():
        if isinstance(module, Attention):
            module.core = attention


# --- expert parallel -------------------------------------------------------------------------------

class AllToAllDispatch:
    """The MoE block's dispatcher interface (models/moe.py): rows sorted by expert go to the rank owning
    the expert, come back after the experts ran."""

    def __init__(self, group, local_experts: int) -> None:
        self.group, self.local = group, local_experts
        self.world = dist.get_world_size(group)

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor):
        from torch.distributed.nn.functional import all_to_all_single

        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # [source rank, local expert]
        by_source = received_counts.view(self.world, self.local)
        send = counts.view(self.world, self.local).sum(1).tolist()
        receive = by_source.sum(1).tolist()
        out = rows.new_empty(sum(receive), rows.shape[1])
        received = all_to_all_single(out, rows, receive, send, group=self.group)
        # Received: by source rank, then expert; the experts want them by expert.
        expert = torch.arange(self.local).repeat(self.world).repeat_interleave(by_source.flatten())
        order = expert.argsort(stable=True)
        return received[order], by_source.sum(0).tolist(), (order, send, receive)

    def combine(self, rows: torch.Tensor, state) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        order, send, receive = state
        out = rows.new_empty(sum(send), rows.shape[1])
        return all_to_all_single(out, rows[order.argsort()], send, receive, group=self.group)


def expert_parallel_by_hand(model: nn.Module, group) -> list[str]:
    """Keep this rank's slice of every MoE layer's experts (weights already initialised whole); returns the
    names of the expert parameters, for DDP to leave out."""
    from fivefold.models.moe import MoE

    warnings.filterwarnings("ignore", message=r"torch.distributed.nn.functional.all_to_all_single is deprecated")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names = []
    for name, block in model.named_modules():
        if isinstance(block, MoE):
            local = block.experts_count // world
            for leaf, weight in list(block.experts.named_parameters(recurse=False)):
                setattr(block.experts, leaf, nn.Parameter(weight.data[rank * local:(rank + 1) * local].clone()))
                names.append(f"{name}.experts.{leaf}")
            block.dispatcher = AllToAllDispatch(group, local)
    return names


# --- the training loop -----------------------------------------------------------------------------

def cosine_lr(step: int, steps: int, warmup: int = 2) -> float:
    """Linear warmup, then cosine to a tenth of the peak (the schedule fivefold's defaults give)."""
    import math

    if step < warmup:
        return LR * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup - 1))
    return 0.1 * LR + 0.45 * LR * (1.0 + math.cos(math.pi * progress))


def plain_step_times(row: str, plan, steps: int, seed: int) -> tuple[list[float], list[float]]:
    """Per-step seconds on this rank and per-step global losses of the hand-written script for `row`."""
    from torch.distributed.device_mesh import init_device_mesh

    from fivefold.data import GlobalBatchLoader, default_dataset
    from fivefold.models import build_model, init_weights

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(plan.model, device="meta")
    if row == "pp2":  # keep this rank's half of the layers, and the embedding or the head
        half = plan.model.layers // 2
        for key in list(model.layers.keys()):
            if (int(key) < half) != (rank == 0):
                del model.layers[key]
        if rank == 0:
            model.norm = model.output = None
        else:
            model.tok_embeddings = None
    elif row == "tp2":
        tensor_parallel_by_hand(model, init_device_mesh("cpu", (world,)))
    elif row == "zero3":
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG
    elif row == "cp2":
        context_parallel_by_hand(model, dist.new_group(list(range(world))))
    model.to_empty(device="cpu")
    init_weights(model, seed)
    expert_names = expert_parallel_by_hand(model, dist.new_group(list(range(world)))) if row == "ep2" else []
    params = list(model.parameters())
    expert_params = [p for n, p in model.named_parameters() if n in expert_names]
    if row in ("dp2", "cp2", "ep2"):
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_names)
        model = nn.parallel.DistributedDataParallel(model)
    decay, no_decay = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.95))
    schedule = None
    if row == "pp2":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        def loss_fn(logits, targets):
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=plan.train.global_batch // plan.micro_batch, loss_fn=loss_fn)
    loader = GlobalBatchLoader(default_dataset(), plan.train.seq_len, plan.train.global_batch, seed)
    share, part = plan.train.global_batch // world, plan.train.seq_len // world
    positions = torch.arange(rank * part, (rank + 1) * part)  # cp2: this rank's half of every row
    times, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps)
        batch = loader.next_batch()
        if row in ("dp2", "zero3", "ep2"):
            batch = batch[rank * share:(rank + 1) * share]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if row == "cp2":
            inputs, targets = inputs[:, positions], targets[:, positions]
        if schedule is None:
            logits = model(inputs, positions=positions) if row == "cp2" else model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            if row == "tp2":
                clip_tensor_parallel(params, 1.0)
            elif row == "ep2":
                grads = [p.grad for p in expert_params]
                torch._foreach_div_(grads, world)  # summed over every rank's tokens; DDP averages the rest
                squared = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
                dist.all_reduce(squared)  # expert shards differ per rank, the rest is replicated
                experts = {id(p) for p in expert_params}
                others = [p.grad for p in params if p.grad is not None and id(p) not in experts]
                squared += torch.stack(torch._foreach_norm(others)).pow(2).sum()
                torch.nn.utils.clip_grads_with_norm_(params, 1.0, squared.sqrt())
            else:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            loss = loss.detach() / world  # this rank's share of the global loss (tp ranks hold the same one)
        else:
            micro_losses: list = []
            if rank == 0:
                schedule.step(inputs)
            else:
                schedule.step(target=targets, losses=micro_losses)
            grads = [p.grad for p in params if p.grad is not None]
            squared = torch.nn.utils.get_total_norm(grads) ** 2
            dist.all_reduce(squared)
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, squared.sqrt())
            loss = torch.stack(micro_losses).mean().detach() if micro_losses else torch.zeros(())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
        losses.append(loss)
    total = torch.stack(losses)
    if world > 1:  # after the timed steps: the global loss of every step, for the comparison with fivefold
        dist.all_reduce(total)
    return times, total.tolist()
