"""What the MoE Parallel Folding paper's runs did that cost/moe_block.py costs (issue 25), against hand formulas:
Megatron-Core 0.8-0.9's sequence-level all-to-all dispatcher (its `mcore` baseline: the tp all-to-alls around the
dispatch, the copies of the hidden-dimension gather and scatter, the router's logits gathered over tp), and token
dropping at capacity factor 1 (the capacity mask in the router, the host sync moved before the first permutation)."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.cost import stack_named
from fivefold.cost.comm import all_gather_time, all_to_all_time, reduce_scatter_time, topology_of
from fivefold.cost.compute import elementwise_time
from fivefold.cost.layout import Layout, rank_envs
from fivefold.cost.moe_block import (CAPACITY_MASK_KERNELS, HOST_SYNC_SECONDS, KERNELS_AFTER_SYNC,
                                     PERMUTE_INDEX_KERNELS, moe_mlp, moe_tokens, sequence_dispatch_group)
from fivefold.cost.passwork import PassWork
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

QWEN = PRESETS["qwen3-30b-a3b"]
LEGACY = dataclasses.replace(stack_named("megatron-core"), moe_sequence_dispatch=True)


def _env():
    plan = Plan(model=QWEN, cluster=parse_cluster("1x8xH100-SXM"), train=TrainSpec(seq_len=4096, global_batch=16),
                dp=4, tp=2, ep=4, etp=2, sequence_parallel=True)
    layout = Layout.of_plan(plan)
    return rank_envs(layout, topology_of(layout.cluster))[0]


def test_the_group_is_the_attention_tp_only_where_megatron_core_0_9_could_run() -> None:
    env = _env()
    assert sequence_dispatch_group(LEGACY, True, 2, env.tp) is env.tp
    assert sequence_dispatch_group(LEGACY, True, 1, env.tp) is None  # folded etp: the token-level dispatcher
    assert sequence_dispatch_group(LEGACY, False, 2, env.tp) is None
    assert sequence_dispatch_group(stack_named("megatron-core"), True, 2, env.tp) is None


def test_the_sequence_level_dispatcher_adds_the_tp_exchanges_copies_and_logit_gather() -> None:
    # tp2 etp2 ep4, 4096 tokens: each rank holds 2048 of them; the legacy dispatcher moves its [2048, h] activation
    # over tp before the permute and back after the unpermute (all_to_all_sp2hp / hp2sp, a copy each), copies the
    # gathered rows twice (the last-dimension gather and scatter), gathers the [2048, experts] logits over tp and
    # routes all 4096 tokens on each rank.
    env = _env()
    device, e, h = env.device, env.device.element_bytes, QWEN.hidden
    split = moe_tokens(4096, 2, 2, True, False)
    token, legacy = PassWork(), PassWork()
    base = moe_mlp(token, QWEN, split, 4, 1.0, device, LEGACY, env.ep)
    block = moe_mlp(legacy, QWEN, split, 4, 1.0, device, LEGACY, env.ep, env.tp)
    own, gathered = 2048 * h * e, block.expert_rows * h * e
    assert block.expert_rows == base.expert_rows == 2048 * QWEN.top_k * 2
    logits = 4096 * QWEN.experts * e
    exchange = 2 * all_to_all_time(own, env.tp)
    assert legacy.forward_comm["tp"] == pytest.approx(all_gather_time(logits, env.tp) + exchange, rel=1e-12)
    assert legacy.backward_comm["tp"] == pytest.approx(reduce_scatter_time(logits, env.tp) + exchange, rel=1e-12)
    assert token.forward_comm["tp"] == token.backward_comm["tp"] == 0.0
    copies = elementwise_time(device, 2 * (2 * own + 2 * gathered), 4)
    probabilities = 2048 * QWEN.experts * 4.0  # the second tp rank's half of the sequence, routed here too
    aux = 2 * probabilities if QWEN.aux_loss_coef > 0 else 0.0
    routing_forward = (elementwise_time(device, 4096 / 2048 * (2 * probabilities + 2048 * e * QWEN.experts
                                                               + probabilities + 2048 * QWEN.top_k * 12 + aux), 3)
                       - elementwise_time(device, 2 * probabilities + 2048 * e * QWEN.experts + probabilities
                                          + 2048 * QWEN.top_k * 12 + aux, 3))
    assert legacy.forward - token.forward == pytest.approx(copies + routing_forward, rel=1e-9)
    assert block.terms.permute - base.terms.permute == pytest.approx(2 * copies, rel=1e-9)  # forward + backward
    logit_exchange = all_gather_time(logits, env.tp) + reduce_scatter_time(logits, env.tp)
    assert block.terms.all_to_all - base.terms.all_to_all == pytest.approx(logit_exchange + 2 * exchange, rel=1e-9)
    assert block.terms.experts == pytest.approx(base.terms.experts, rel=1e-12)


def test_token_dropping_masks_the_gates_and_syncs_before_the_first_permutation() -> None:
    # tp1 ep4 on 8 H100, 4096 tokens routed here: the capacity mask passes over the fp32 [4096, experts] gates (5
    # kernels forward, 1 backward); the sync now splits the forward before the permute, whose index kernels the CPU
    # issues behind it.
    env = _env()
    device, stack = env.device, stack_named("megatron-core")
    split = moe_tokens(4096, 1, 1, False, False)
    kept, dropped = PassWork(), PassWork()
    base = moe_mlp(kept, QWEN, split, 4, 1.0, device, stack, env.ep)
    block = moe_mlp(dropped, QWEN, split, 4, 1.0, device, dataclasses.replace(stack, moe_drops_tokens=True), env.ep)
    gates = 4096 * QWEN.experts
    mask_forward = elementwise_time(device, gates * 18 + 4096 * QWEN.top_k * 8, CAPACITY_MASK_KERNELS[0])
    mask_backward = elementwise_time(device, gates * 9, CAPACITY_MASK_KERNELS[1])
    assert block.terms.router - base.terms.router == pytest.approx(mask_forward + mask_backward, rel=1e-9)
    assert kept.host_wait == pytest.approx(HOST_SYNC_SECONDS + KERNELS_AFTER_SYNC * stack.host_seconds_per_kernel)
    assert dropped.host_wait - kept.host_wait == pytest.approx(PERMUTE_INDEX_KERNELS * stack.host_seconds_per_kernel)
    assert kept.synced_at is not None and dropped.synced_at is not None
    # The permute's forward (the routed copies gathered and, ep > 1, sorted by local expert: 4096 x top_k rows
    # each way, read and written) now follows the sync; the capacity mask comes before it.
    permute_forward = elementwise_time(device, 8 * 4096 * QWEN.top_k * QWEN.hidden * device.element_bytes, 4)
    assert block.expert_rows == 4096 * QWEN.top_k
    assert kept.synced_at[0] - dropped.synced_at[0] == pytest.approx(permute_forward - mask_forward, rel=1e-9)
    assert kept.synced_at[1] - dropped.synced_at[1] == 4 - CAPACITY_MASK_KERNELS[0]
