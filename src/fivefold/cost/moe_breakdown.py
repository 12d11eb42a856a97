"""The MoE terms of `estimate` (issue 25): cost/moe_block.py's terms of one block, per step on the slowest rank in
the time breakdown, and the dispatched token copies among the fullest rank's activations."""

from __future__ import annotations

import dataclasses

from fivefold.cost.layer import LayerShape
from fivefold.cost.layout import Layout, RankEnv, RankGroup, layer_costs
from fivefold.cost.memory import RankMemory, moe_dispatched_bytes
from fivefold.cost.moe import moe_share
from fivefold.cost.moe_block import MoETerms, moe_mlp, moe_tokens, sequence_dispatch_group
from fivefold.cost.passwork import PassWork
from fivefold.cost.results import Estimate
from fivefold.cost.stack import SoftwareStack


def moe_layer_terms(layout: Layout, env: RankEnv, stack: SoftwareStack) -> MoETerms:
    """The terms of one MoE block for one micro-batch on a rank like `env` (the same work layer_cost adds)."""
    split = moe_tokens(layout.micro_batch * layout.train.seq_len // layout.cp, layout.tp, layout.etp,
                       layout.sequence_parallel, stack.moe_splits_tokens_over_tp)
    return moe_mlp(PassWork(), layout.model, split, layout.ep, layout.train.expert_imbalance, env.device, stack,
                   env.ep, sequence_dispatch_group(stack, layout.sequence_parallel, layout.etp, env.tp),
                   layout.train.expert_load).terms


def host_sync_seconds(layout: Layout, env: RankEnv, stack: SoftwareStack) -> float:
    """What the host sync on token counts adds to one (average) layer's passes for one micro-batch: the round trip
    and the kernels issued behind it (MoETerms.host_sync), and the CPU's run-ahead lost at the sync
    (passwork.synced_forward): the layer as costed, less the same layer with a sync-free dispatcher."""
    if not stack.moe_dispatch_syncs_host:
        return 0.0
    synced = layer_costs(layout, env, stack).layer
    free = layer_costs(layout, env, dataclasses.replace(stack, moe_dispatch_syncs_host=False)).layer
    return (synced.forward + synced.recompute) - (free.forward + free.recompute)


def with_moe_parts(estimate: Estimate, layout: Layout, slowest: RankGroup, fullest: RankGroup,
                   stack: SoftwareStack, element_bytes: int) -> Estimate:
    """`estimate` with its MoE terms named: in the time breakdown (the slowest rank's, per step) and among the
    fullest rank's activations (the dispatched token copies)."""
    if layout.model.is_moe:
        estimate.breakdown_s = with_moe_terms(estimate.breakdown_s, layout, slowest.env, stack,
                                              estimate.micro_batches * slowest.layers)
        estimate.memory = with_moe_memory(estimate.memory, layout, fullest, element_bytes)
    return estimate


def with_moe_terms(breakdown: dict[str, float], layout: Layout, env: RankEnv, stack: SoftwareStack,
                   layer_passes: float) -> dict[str, float]:
    """`estimate`'s breakdown with the MoE terms split out of compute, host overhead and ep_comm (same sum):
    `layer_passes` = micro-batches x transformer layers of the slowest rank. Unchanged for a dense model, or
    where the split would leave a part negative (a host-bound eager CPU rank)."""
    if not layout.model.is_moe or layer_passes <= 0:
        return breakdown
    terms = moe_layer_terms(layout, env, stack)
    count = layer_passes * moe_share(layout.model)
    gpu = {"moe_router": terms.router, "moe_permute": terms.permute, "moe_experts": terms.experts,
           "moe_shared_experts": terms.shared_experts}
    rest = breakdown["compute"] - count * sum(gpu.values())
    host_sync = layer_passes * host_sync_seconds(layout, env, stack)
    host = breakdown.get("host_overhead", 0.0) - host_sync
    if rest < 0 or host < -1e-12:
        return breakdown
    out = {"compute": rest, **{key: count * value for key, value in gpu.items()}}
    for key, value in breakdown.items():
        if key == "host_overhead":
            out[key], out["moe_host_sync"] = max(0.0, host), host_sync
        elif key != "compute":
            out[key] = value
    return out


def with_moe_memory(memory: RankMemory, layout: Layout, group: RankGroup, element_bytes: int) -> RankMemory:
    """`memory` (of a rank like `group`'s) with the dispatched MoE token copies among its activations named."""
    if not layout.model.is_moe or group.activation <= 0:
        return memory
    shape = LayerShape(layout.model, layout.train.seq_len, layout.micro_batch, layout.tp, layout.cp, layout.ep,
                       layout.sequence_parallel, layout.recompute, layout.train.expert_imbalance,
                       cp_method=layout.cp_method, etp=layout.etp)
    per_micro_batch = group.layers * moe_share(layout.model) * moe_dispatched_bytes(shape, element_bytes)
    return dataclasses.replace(memory, moe_dispatched=memory.activations * per_micro_batch / group.activation)
