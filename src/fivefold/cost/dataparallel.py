"""Data-parallel and ZeRO communication of a step, how much of it hides behind compute, and the optimizer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fivefold.cost.comm import GroupLink, Topology, all_gather_time, all_reduce_time
from fivefold.cost.layer import padded_vocab
from fivefold.cost.layout import Layout, RankEnv
from fivefold.cost.stack import SoftwareStack

if TYPE_CHECKING:
    from fivefold.cost.step import RankGroup

# Adam step traffic per parameter on its rank (multi-tensor apply, memory-bound): read fp32 master,
# momentum, variance and the gradient, write the three back and the 16-bit weight copy, plus the
# gradient-norm and unscale passes: ~36 bytes; fp16 adds the fp16 -> fp32 gradient copy of Megatron's
# loss-scaling optimizer (~8 more).
OPTIMIZER_BYTES_PER_PARAM = {"bf16": 36.0, "fp16": 44.0, "fp32": 36.0}


def optimizer_time(layout: Layout, env: RankEnv, dense: float, expert: float) -> float:
    """Adam over this rank's (ZeRO-sharded) parameters: a memory-bound sweep."""
    if layout.zero >= 1:
        shard = layout.dp * layout.cp
        dense, expert = dense / shard, expert / max(1, shard // layout.ep)
    return (dense + expert) * OPTIMIZER_BYTES_PER_PARAM[layout.train.dtype] / env.device.bandwidth


def data_parallel_time(layout: Layout, stack: SoftwareStack, groups: list[RankGroup], topology: Topology,
                   first_device: int, last_device: int) -> tuple[float, float]:
    """(total, exposed) seconds of gradient reduction and parameter gathering, worst pipeline rank.

    ZeRO-0 all-reduces gradients once per step; ZeRO-1 reduce-scatters them and all-gathers the updated
    weights (same volume, Megatron's distributed optimizer); ZeRO-2 reduce-scatters every micro-batch
    (gradients stay sharded); ZeRO-3 also all-gathers the weights before every forward and backward.
    Overlap (when the stack does it): a reduction launched bucket by bucket hides behind the backward of
    the last micro-batch except its last bucket (~one layer); weight gathers hide behind forward. In
    1F1B-like schedules rank r finishes its last backward r backward-steps before rank 0, which is slack.
    With tied embeddings and pp > 1 the first and last stages all-reduce the embedding gradient.
    """
    m, dtype = layout.model, layout.train.dtype
    g = stack.gradient_bytes(dtype)
    e = 4 if dtype == "fp32" else 2
    micro_batches = layout.num_micro_batches
    drains_in_order = layout.pp > 1 and layout.schedule != "zbv"
    step_back = min(group.work[1] + group.work[2] for group in groups)
    tied_sync = 0.0
    if m.tied_embeddings and layout.pp > 1:
        link = topology.pair_link(first_device, last_device)
        tied_sync = all_reduce_time(padded_vocab(m.vocab, layout.tp) * m.hidden / layout.tp * g, link)
    worst_total = worst_exposed = 0.0
    for group in groups:
        forward, backward_input, backward_weight = group.work
        backward = backward_input + backward_weight
        tail = 1.0 / max(1, group.layers)
        total = exposed = 0.0
        for params, link in ((group.dense, group.env.replicas), (group.expert, group.env.expert_replicas)):
            if params <= 0 or link.size <= 1:
                continue
            reduce, gather, repeats = zero_volumes(layout.zero, params, link, g, e, micro_batches)
            total += repeats * reduce + (gather if layout.zero in (1, 2) else repeats * gather)
            if not stack.overlap_grad_reduce:
                exposed += repeats * reduce
            else:
                exposed += repeats * max(reduce * tail, reduce - backward)
            gathers = 1 if layout.zero in (1, 2) else repeats
            if not stack.overlap_param_gather:
                exposed += gathers * gather
            else:
                exposed += gathers * max(gather * tail, gather - forward)
        if group.first or group.last:
            total += tied_sync
            exposed += tied_sync
        slack = group.ranks[0] * step_back if drains_in_order else 0.0
        worst_total = max(worst_total, total)
        worst_exposed = max(worst_exposed, exposed - slack)
    return worst_total, max(0.0, worst_exposed)


def zero_volumes(zero: int, params: float, link: GroupLink, grad_bytes: int, weight_bytes: int,
                  micro_batches: int) -> tuple[float, float, int]:
    """(reduce seconds, gather seconds, times per step) of one ZeRO level for `params` over `link`."""
    if zero == 0:
        return all_reduce_time(params * grad_bytes, link), 0.0, 1
    gather = all_gather_time(params * weight_bytes, link)
    reduce = all_gather_time(params * grad_bytes, link)  # reduce-scatter costs what all-gather does
    if zero == 1:
        return reduce, gather, 1
    if zero == 2:
        return reduce, gather, micro_batches
    return reduce + gather, gather, micro_batches  # ZeRO-3 re-gathers the weights for backward
