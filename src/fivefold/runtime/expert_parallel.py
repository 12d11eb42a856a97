"""Expert parallelism folded over the dp x cp ranks (MoE parallel folding, Liu et al. 2025).

ep does not multiply the world size: the (dp, cp) ranks of one pp stage and tp coordinate, numbered
dp-major as the plan's mesh numbers them, are cut into consecutive groups of `ep`. A second view of the
same world, mesh (pp, edp, ep, tp) with edp = dp*cp/ep, names those groups:

    ep   ranks that split the experts: expert e lives on ep rank e // (experts/ep); tokens travel to it
         with all_to_all_single (counts exchanged first, then the rows with those splits) and back.
    edp  ranks that hold the same experts (expert data parallel): their expert gradients are summed
         (FSDP2 `fully_shard` with --zero 1-3, `replicate` with zero 0), never averaged.

Expert weights are DTensors sharded on the expert dim over `ep`, so seeded init, checkpoints and
resharding across an ep change (DCP) treat them like any other sharded tensor. The all-to-all moves
token copies, each owner computes its experts on every copy sent to it, so an expert's gradient is the
sum over all tokens of the ep group; the loss is divided once by the global token count (train.py).

Under tensor parallelism attention is split over tp as usual; the MoE block is not: every tp rank of a
group holds the same experts (its own ep shard) and routes the same, whole sequence (with sequence
parallel the block's input is gathered over tp first and its output cut back to this rank's part), so
expert gradients are equal over tp and need no tp reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from fivefold.errors import require
from fivefold.models.moe import MoE
from fivefold.spec import Plan

EXPERT_MESH_DIMS = ("pp", "edp", "ep", "tp")


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty(sum(out_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class AllToAllDispatch:
    """Send each token copy to the ep rank that owns its expert; bring the results back."""

    def __init__(self, group: dist.ProcessGroup, ep: int, experts: int) -> None:
        self.group, self.ep, self.local = group, ep, experts // ep

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, list[int], object]:
        # rows are sorted by expert, so the rows for ep rank r are one contiguous block.
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # [source rank, local expert]
        by_source = received_counts.view(self.ep, self.local)
        in_splits = counts.view(self.ep, self.local).sum(1).tolist()
        out_splits = by_source.sum(1).tolist()
        received = AllToAll.apply(rows, out_splits, in_splits, self.group)
        # Received rows are ordered by source rank, then local expert; the experts want them by expert.
        expert_of_row = torch.arange(self.local, device=rows.device).repeat(self.ep).repeat_interleave(
            by_source.flatten())
        order = expert_of_row.argsort(stable=True)
        return received[order], by_source.sum(0).tolist(), (order, in_splits, out_splits)

    def combine(self, rows: torch.Tensor, state: object) -> torch.Tensor:
        order, in_splits, out_splits = state
        return AllToAll.apply(rows[order.argsort()], in_splits, out_splits, self.group)


def check_moe_runnable(plan: Plan) -> None:
    """What this runtime cannot run with an MoE model, refused before any process starts."""
    if plan.ep > 1:
        require(not plan.replica_micro_batches, "plan.replica_micro_batches", list(plan.replica_micro_batches),
                "uneven replicas cannot share experts: every rank of an ep group must run the same number of "
                "all-to-alls; use even micro-batches with ep > 1")
    if plan.cp > 1:
        require(plan.model.aux_loss_coef == 0, "model.aux_loss_coef", plan.model.aux_loss_coef,
                "the per-sequence auxiliary loss is not summed over a sequence split by cp yet; use cp=1 or 0")


def expert_mesh(plan: Plan, device: torch.device) -> DeviceMesh:
    """The (pp, edp, ep, tp) view of the world: the same rank numbering as the plan's (pp, dp, cp, tp)."""
    edp = plan.dp * plan.cp // plan.ep
    return init_device_mesh(device.type, (plan.pp, edp, plan.ep, plan.tp), mesh_dim_names=EXPERT_MESH_DIMS)


def moe_blocks(model: nn.Module) -> list[MoE]:
    return [module for module in model.modules() if isinstance(module, MoE)]


def moe_tensor_parallel_style(sequence_parallel: bool) -> PrepareModuleInputOutput | None:
    """What tensor parallelism does to an MoE block: nothing without sequence parallel (its input is the
    whole replicated sequence); with it, gather the sequence before and keep this rank's part after."""
    if not sequence_parallel:
        return None
    return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_input=True, output_layouts=(Replicate(),),
                                    desired_output_layouts=(Shard(1),), use_local_output=True)


def prepare_moe(model: nn.Module, plan: Plan, mesh: DeviceMesh | None, param_dtype: torch.dtype | None,
                under_ddp: bool = False) -> None:
    """Before data parallelism wraps the blocks: the auxiliary loss scale, and under ep > 1 the experts
    sharded over ep and wrapped for expert data parallelism over edp. `under_ddp`: the model runs under
    DistributedDataParallel (parallelize.uses_ddp: edp = 1), which leaves the experts alone, so they need
    no wrapper."""
    for block in moe_blocks(model):
        block.aux_loss_scale = 1.0 / (plan.model.moe_layers * plan.train.global_batch)
    if plan.ep == 1:
        return
    assert mesh is not None
    group = mesh.get_group("ep")
    for block in moe_blocks(model):
        experts = block.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, mesh["ep"], [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded))
        block.dispatcher = AllToAllDispatch(group, plan.ep, plan.model.experts)
        if plan.dp * plan.cp > 1 and not under_ddp:
            _wrap_expert_data_parallel(experts, mesh["edp"], plan.zero, param_dtype)


def _wrap_expert_data_parallel(experts: nn.Module, edp_mesh: DeviceMesh, zero: int,
                               param_dtype: torch.dtype | None) -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
        MixedPrecisionPolicy()
    if zero == 0:
        replicate(experts, mesh=edp_mesh, mp_policy=mixed)
    else:
        fully_shard(experts, mesh=edp_mesh, reshard_after_forward=zero == 3, mp_policy=mixed)
    assert isinstance(experts, FSDPModule)
    experts.set_gradient_divide_factor(1.0)  # summed over the expert replicas, as every gradient here
    experts.set_force_sum_reduction_for_comms(True)


def forget_metadata_inference(schedule: object, parts: dict[int, nn.Module]) -> None:
    """torch.distributed.pipelining runs every stage once on its first step to learn the shapes passed
    between stages; that forward is no training and must not count in the expert load or auxiliary loss.
    Every schedule initialises its stages through _initialize_pp_stages before its first real forward."""
    initialize = schedule._initialize_pp_stages  # type: ignore[attr-defined]

    def initialize_then_forget(*args, **kwargs):
        result = initialize(*args, **kwargs)
        for part in parts.values():
            for block in moe_blocks(part):
                block.take_stats()
        return result

    schedule._initialize_pp_stages = initialize_then_forget  # type: ignore[attr-defined]


def moe_step_metrics(parts: dict[int, nn.Module], plan: Plan, device: torch.device, update_bias: bool) -> dict:
    """The step's auxiliary loss and expert load over the whole world (one all-reduce), and the
    auxiliary-loss-free bias update. Every rank returns the same numbers. With ep > 1 also the busiest ep
    rank's tokens over the mean (averaged over the MoE layers): the measured train.expert_imbalance.

    Layers of other stages are zero here and filled by their stage; dp/cp ranks add disjoint tokens;
    tp ranks all count the same tokens, hence the division by tp.
    """
    model = plan.model
    moe_layer_ids = [i for i in range(model.layers) if model.is_moe_layer(i)]
    totals = torch.zeros(len(moe_layer_ids) * model.experts + 1, dtype=torch.float64)
    blocks: dict[int, MoE] = {}
    for part in parts.values():
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                layer = int(name.split("layers.")[1].split(".")[0])
                blocks[layer] = module
                load, aux = module.take_stats()
                row = moe_layer_ids.index(layer)
                totals[row * model.experts:(row + 1) * model.experts] = load.cpu()
                totals[-1] += aux
    if dist.is_initialized() and dist.get_world_size() > 1:
        totals = totals.to(device)
        dist.all_reduce(totals)
        totals = totals.cpu()
    totals /= plan.tp
    loads = totals[:-1].view(len(moe_layer_ids), model.experts)
    if update_bias and model.router_bias_rate > 0:
        for layer, block in blocks.items():
            load = loads[moe_layer_ids.index(layer)]
            step = model.router_bias_rate * torch.sign(load.mean() - load)
            block.expert_bias.add_(step.to(block.expert_bias.device, torch.float32))
    per_layer = _max_over_mean(loads).tolist()
    metrics = {"aux_loss": totals[-1].item(), "expert_load_max_over_mean": max(per_layer),
               "expert_load_per_layer": [round(v, 4) for v in per_layer]}
    if plan.ep > 1:  # what the step waits for: the busiest ep rank's experts (train.expert_imbalance's meaning)
        per_rank = loads.view(len(moe_layer_ids), plan.ep, -1).sum(dim=2)
        metrics["expert_rank_imbalance"] = _max_over_mean(per_rank).mean().item()
    return metrics


def _max_over_mean(loads: torch.Tensor) -> torch.Tensor:
    """Per row (an MoE layer): the largest load over the mean load."""
    return loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-12)
