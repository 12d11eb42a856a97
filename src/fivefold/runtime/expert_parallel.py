"""Expert parallelism folded over the tp x cp x dp ranks (MoE Parallel Folding, Liu et al. 2025).

ep does not multiply the world size: the tp*cp*dp ranks of one pp stage, numbered as the plan's mesh
numbers them (tp innermost), are regrouped for the MoE layers as edp x ep x etp, etp innermost
(spec/folding.py). A second view of the same world, mesh (pp, edp, ep, etp), names those groups:

    ep   ranks that split the experts: expert e lives on ep rank e // (experts/ep); tokens travel to it
         with all_to_all_single (counts exchanged first, then the rows with those splits) and back.
    etp  ranks that split each expert's matrices (w1/w3 by column, w2 by row): they all-gather the rows
         their ep rank received and reduce-scatter the partial outputs (runtime/expert_folding.py).
    edp  ranks that hold the same expert slice (expert data parallel): their expert gradients are summed
         (FSDP2 `fully_shard` with --zero 1-3, `replicate` with zero 0), never averaged.

Expert weights are DTensors sharded on the expert dim over `ep` (and on the ffn dim over `etp`), so seeded
init, checkpoints and resharding across a folding change (DCP) treat them like any other sharded tensor.
Each owner computes its experts on every copy sent to it, so an expert's gradient is the sum over the
tokens of its ep group; the loss is divided once by the global token count (train.py).

Under tensor parallelism attention is split over tp as usual; the MoE block routes only this tp rank's
part of the sequence (with sequence parallel: the part it holds; without: a cut of the replicated input,
gathered again after the block), so no tp rank repeats another's expert work; the router's and shared
experts' gradients are summed over tp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInput

from fivefold.errors import require
from fivefold.models.moe import MoE
from fivefold.runtime.expert_folding import AllToAllDispatch, ExpertTensorParallel, FoldedDispatch, SplitTokens
from fivefold.spec import ModelSpec, Plan
from fivefold.spec.folding import EXPERT_DIMS


def check_moe_runnable(plan: Plan) -> None:
    """What this runtime cannot run with an MoE model, refused before any process starts."""
    if plan.ep > 1 or plan.etp > 1:
        require(not plan.replica_micro_batches, "plan.replica_micro_batches", list(plan.replica_micro_batches),
                "uneven replicas cannot share experts: every rank of an ep group must run the same number of "
                "all-to-alls; use even micro-batches with ep > 1")
    if plan.tp > 1:
        local = plan.train.seq_len // plan.cp
        require(local % plan.tp == 0, "train.seq_len", plan.train.seq_len,
                f"the MoE layers split each rank's {local} tokens of a sequence over tp={plan.tp}: use a "
                f"--seq-len divisible by cp x tp = {plan.cp * plan.tp}")


def check_expert_gemm(plan: Plan, choice: str, device: str) -> None:
    """--expert-gemm grouped|loop: an MoE model, and for grouped a torch and device whose torch._grouped_mm runs
    (CUDA: sm90+ in bf16; CPU: fp32)."""
    from fivefold.models.moe import grouped_mm_on_cuda, has_grouped_mm

    require(plan.model.is_moe, "--expert-gemm", choice, f"chooses how MoE experts run; {plan.model.name} is dense "
            "(no experts): leave it out")
    if choice != "grouped":
        return
    require(has_grouped_mm(), "--expert-gemm", choice, f"torch {torch.__version__} has no torch._grouped_mm (2.8 "
            "and later have it); use --expert-gemm loop")
    if device == "cuda":
        require(grouped_mm_on_cuda(), "--expert-gemm", choice, "torch._grouped_mm needs a GPU of compute capability "
                "9.0 or newer (H100, H200, B200); use --expert-gemm loop")
        require(plan.train.dtype != "fp32", "--expert-gemm", choice, "torch._grouped_mm computes in bf16 on CUDA; "
                "train in bf16 (or fp8), or use --expert-gemm loop with fp32")


def folds_experts(plan: Plan) -> bool:
    """Whether the MoE layers need the expert view of the world: experts split (ep, etp) or tokens split
    over tp (then expert gradients are summed over edp, which spans tp)."""
    return plan.model.is_moe and (plan.ep > 1 or plan.etp > 1 or plan.tp > 1)


def expert_mesh(plan: Plan, device: torch.device) -> DeviceMesh:
    """The (pp, edp, ep, etp) view of the world: the same rank numbering as the plan's (pp, dp, cp, tp)."""
    return init_device_mesh(device.type, plan.expert_mesh_shape, mesh_dim_names=EXPERT_DIMS)


def moe_blocks(model: nn.Module) -> list[MoE]:
    return [module for module in model.modules() if isinstance(module, MoE)]


def set_expert_gemm(model: nn.Module, choice: str) -> None:
    """How the experts of every MoE block run (--expert-gemm: auto, grouped or loop; models/moe.py)."""
    for block in moe_blocks(model):
        block.experts.gemm = choice


def moe_tensor_parallel_style(sequence_parallel: bool) -> PrepareModuleInput | None:
    """What tensor parallelism does to an MoE block: nothing without sequence parallel (the block cuts its
    replicated input itself); with it, the block takes this rank's part of the sequence as a plain tensor
    and returns its output for that part."""
    if not sequence_parallel:
        return None
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)


def sequence_split(plan: Plan, world: DeviceMesh) -> SplitTokens | None:
    """How the MoE blocks of this rank split their tokens (tp > 1 or cp > 1), else None."""
    if plan.tp == 1 and plan.cp == 1:
        return None
    if plan.tp > 1 and plan.cp > 1:
        sequence_group = world["cp", "tp"]._flatten("cp_tp").get_group()
    else:
        sequence_group = world.get_group("tp" if plan.tp > 1 else "cp")
    tp_group = world.get_group("tp") if plan.tp > 1 else None
    tp_index = world.get_local_rank("tp")
    return SplitTokens(tp_group, plan.tp, tp_index, plan.tp > 1 and not plan.sequence_parallel, sequence_group,
                       plan.tp * plan.cp)


def prepare_moe(model: nn.Module, plan: Plan, mesh: DeviceMesh | None, param_dtype: torch.dtype | None,
                under_ddp: bool = False, tokens: SplitTokens | None = None) -> None:
    """Before data parallelism wraps the blocks: the auxiliary loss scale, the token split under tp/cp,
    and with folds_experts the experts sharded over ep x etp and wrapped for expert data parallelism over
    edp. `under_ddp`: the model runs under DistributedDataParallel (parallelize.uses_ddp: edp = 1), which
    leaves the experts alone, so they need no wrapper."""
    for block in moe_blocks(model):
        block.aux_loss_scale = 1.0 / (plan.model.moe_layers * plan.train.global_batch)
        if tokens is not None:
            block.tokens, block.synced = tokens, tokens.synced
    if mesh is None:
        return
    ep_dispatch = (AllToAllDispatch(mesh.get_group("ep"), plan.ep, plan.model.experts, mesh.get_local_rank("ep"))
                   if plan.ep > 1 else None)
    etp = ExpertTensorParallel(mesh.get_group("etp"), plan.etp) if plan.etp > 1 else None
    for block in moe_blocks(model):
        experts = block.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            if plan.etp > 1:  # w1/w3 [E, f, h] by column (dim 1), w2 [E, h, f] by row (dim 2)
                placements = [Shard(0), Shard(2 if name == "w2" else 1)]
                sharded = distribute_tensor(param.data, mesh["ep", "etp"], placements, src_data_rank=None)
            else:
                sharded = distribute_tensor(param.data, mesh["ep"], [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded))
        block.dispatcher = FoldedDispatch(ep_dispatch, etp)
        if (plan.dp * plan.cp > 1 or plan.edp > 1) and not under_ddp:
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

    Layers of other stages are zero here and filled by their stage; every rank of a stage routes disjoint
    tokens (tp ranks split them too), so the sums are the global batch's.
    """
    model = plan.model
    moe_layer_ids = [i for i in range(model.layers) if model.is_moe_layer(i)]
    # Filled on the device and read once: the step's only wait on the GPU for these statistics.
    totals = torch.zeros(len(moe_layer_ids) * model.experts + 1, dtype=torch.float64, device=device)
    blocks: dict[int, MoE] = {}
    for part in parts.values():
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                layer = int(name.split("layers.")[1].split(".")[0])
                blocks[layer] = module
                load, aux = module.take_stats()
                row = moe_layer_ids.index(layer)
                totals[row * model.experts:(row + 1) * model.experts] = load.to(device)
                totals[-1] += aux.to(device) if isinstance(aux, torch.Tensor) else aux
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    totals = totals.cpu()
    loads = totals[:-1].view(len(moe_layer_ids), model.experts)
    if update_bias and model.router_bias_rate > 0:
        for layer, block in blocks.items():
            load = loads[moe_layer_ids.index(layer)]
            step = model.router_bias_rate * torch.sign(load.mean() - load)
            block.expert_bias.add_(step.to(block.expert_bias.device, torch.float32))
    per_layer = _max_over_mean(loads).tolist()
    tokens = loads.sum(dim=1) / model.top_k  # every token makes top_k copies, at most one per expert
    busiest = loads.max(dim=1)
    ran = {block.experts.ran for block in blocks.values()} - {None}
    metrics = {"aux_loss": totals[-1].item(), "expert_load_max_over_mean": max(per_layer),
               # what ran on this rank ("grouped" or "loop"; every rank decides alike), for the report's prediction
               **({"expert_gemm": "grouped" if "grouped" in ran else "loop"} if ran else {}),
               "expert_load_per_layer": [round(v, 4) for v in per_layer],
               # per MoE layer: its busiest expert and whether that expert took every token (CollapseWatch)
               "expert_busiest": [[int(e), bool(n > 0 and n >= t)] for e, n, t in
                                  zip(busiest.indices.tolist(), busiest.values.tolist(), tokens.tolist())],
               # token copies the experts computed per MoE layer: tokens x top_k when no rank repeats another's
               "expert_copies": int(loads.sum(dim=1).max().item())}
    if plan.ep > 1:  # what the step waits for: the busiest ep rank's experts (train.expert_imbalance's meaning)
        per_rank = loads.view(len(moe_layer_ids), plan.ep, -1).sum(dim=2)
        metrics["expert_rank_imbalance"] = _max_over_mean(per_rank).mean().item()
    return metrics


# Steps in a row a layer's busiest expert must take every token before the run reports an expert collapse.
COLLAPSE_STEPS = 3


def balance_warning(model: ModelSpec) -> str | None:
    """The launch warning for an MoE model that nothing keeps balanced: no auxiliary loss, no bias update."""
    if not model.is_moe or model.aux_loss_coef > 0 or model.router_bias_rate > 0:
        return None
    return (f"{model.name} is an MoE model with neither an auxiliary loss (aux_loss_coef=0) nor a bias update "
            "(router_bias_rate=0): nothing stops the router from sending every token to the same experts; set "
            "aux_loss_coef (e.g. 0.01) or router_bias_rate (e.g. 0.001) in the model")


class CollapseWatch:
    """Expert collapse: an MoE layer whose busiest expert takes every token (its load max/mean is experts / top_k,
    the most it can be) for COLLAPSE_STEPS steps in a row. observe() returns each collapse once, when its streak
    reaches that length; a layer that recovers and collapses again is reported again."""

    def __init__(self, model: ModelSpec, steps: int = COLLAPSE_STEPS) -> None:
        self.layers = [i for i in range(model.layers) if model.is_moe_layer(i)]
        self.top_k, self.steps = model.top_k, steps
        self.since: dict[int, tuple[int, int]] = {}  # layer -> (first step of the streak, expert)

    def observe(self, step: int, busiest: list[tuple[int, bool]]) -> list[dict]:
        """`busiest`: per MoE layer (moe_step_metrics' expert_busiest), the busiest expert and whether it took
        every token this step."""
        found = []
        for layer, (expert, every_token) in zip(self.layers, busiest):
            streak = self.since.get(layer)
            if not every_token or (streak is not None and streak[1] != expert):
                self.since.pop(layer, None)
                if not every_token:
                    continue
            first, _ = self.since.setdefault(layer, (step, expert))
            if step - first + 1 == self.steps:
                found.append({"layer": layer, "expert": expert, "since_step": first, "steps": self.steps})
        return found


def describe_collapse(found: dict, model: ModelSpec) -> str:
    return (f"expert collapse: MoE layer {found['layer']} has sent every token to expert {found['expert']} for "
            f"{found['steps']} steps (from step {found['since_step']}; load {model.experts // model.top_k}x the "
            "mean, the most it can be); raise aux_loss_coef or router_bias_rate")


def _max_over_mean(loads: torch.Tensor) -> torch.Tensor:
    """Per row (an MoE layer): the largest load over the mean load."""
    return loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-12)
