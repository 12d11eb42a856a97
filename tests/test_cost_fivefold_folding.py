"""The `fivefold` stack's MoE folding in the cost model (issue 26): each tp rank routes its own tokens / tp with or
without sequence parallel (runtime/expert_folding.py SplitSequence / GatherSequence), the block's output all-gathered
over tp without SP, router and shared-expert gradients all-reduced over tp, etp exchanging the dispatched copies;
each checked against the hand formula of its collective."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fivefold.cli import main
from fivefold.cost import STACKS, Layout
from fivefold.cost.comm import (SELF, all_gather_time, all_reduce_time, all_to_all_time, reduce_scatter_time,
                                topology_of)
from fivefold.cost.layer import LayerShape, layer_cost
from fivefold.cost.layout import rank_envs
from fivefold.cost.moe_breakdown import moe_layer_terms
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

FIVEFOLD = STACKS["fivefold"]
# Qwen3-30B-A3B's block with one shared expert, so the shared experts' gradient all-reduces show.
MODEL = replace(PRESETS["qwen3-30b-a3b"], layers=4, shared_experts=1)
TRAIN = TrainSpec(seq_len=4096, global_batch=64)


def _layout(**fields) -> Layout:
    return Layout.of_plan(Plan(model=MODEL, cluster=parse_cluster("2x8xH100-SXM"), train=TRAIN, zero=1, **fields))


def _shape(layout: Layout) -> LayerShape:
    return LayerShape(MODEL, TRAIN.seq_len, layout.micro_batch, layout.tp, layout.cp, layout.ep,
                      layout.sequence_parallel, "none", TRAIN.expert_imbalance, etp=layout.etp)


def test_each_tp_rank_dispatches_its_own_tokens_with_or_without_sp() -> None:
    for sequence_parallel in (False, True):
        layout = _layout(tp=2, dp=8, ep=16, micro_batch=1, sequence_parallel=sequence_parallel)
        env = rank_envs(layout, topology_of(layout.cluster))[0]
        terms = moe_layer_terms(layout, env, FIVEFOLD)
        # 4096 tokens per tp group, 2048 per rank; each sends top_k (8) copies of 2048 hidden bf16 values,
        # dispatch and combine forward and backward, after the counts' all-to-all (128 experts x 8 bytes).
        copies = 2048 * 8 * 2048 * 2
        expected = all_to_all_time(128 * 8.0, env.ep) + 4 * all_to_all_time(copies, env.ep)
        assert terms.all_to_all == pytest.approx(expected, rel=1e-12)
        # megatron-core without SP routes all 4096 tokens on every tp rank: twice the dispatched bytes.
        if not sequence_parallel:
            core = moe_layer_terms(layout, env, STACKS["megatron-core"])
            assert core.all_to_all == pytest.approx(all_to_all_time(128 * 8.0, env.ep)
                                                    + 4 * all_to_all_time(2 * copies, env.ep), rel=1e-12)


def test_tp_collectives_of_the_block_at_their_real_size() -> None:
    layout = _layout(tp=2, dp=8, ep=8, micro_batch=1, sequence_parallel=False)
    env = rank_envs(layout, topology_of(layout.cluster))[0]
    cost = layer_cost(_shape(layout), env.device, FIVEFOLD, env.tp, SELF, env.ep, env.etp)
    h, e, tokens = MODEL.hidden, 2, 4096
    hidden = tokens * h * e
    # Attention: one all-reduce forward, one backward (fivefold does not overlap it with the wgrad GEMM).
    attention = 2 * all_reduce_time(hidden, env.tp)
    # MoE block without SP: the output all-gathered forward, the cut input's gradient all-gathered backward;
    # router [128, 2048] and the shared expert's three [768 x 2048] matrices: one gradient all-reduce each.
    gathers = 2 * all_gather_time(hidden, env.tp)
    gradients = all_reduce_time(128 * h * e, env.tp) + 3 * all_reduce_time(768 * h * e, env.tp)
    assert cost.tp_comm == pytest.approx(attention + gathers + gradients, rel=1e-12)
    # With SP the block's input already is the rank's part: only the gradient all-reduces remain for the block.
    sp = _layout(tp=2, dp=8, ep=8, micro_batch=1, sequence_parallel=True)
    sp_env = rank_envs(sp, topology_of(sp.cluster))[0]
    sp_cost = layer_cost(_shape(sp), sp_env.device, FIVEFOLD, sp_env.tp, SELF, sp_env.ep, sp_env.etp)
    attention_sp = 2 * (all_gather_time(hidden, sp_env.tp) + reduce_scatter_time(hidden, sp_env.tp))
    assert sp_cost.tp_comm == pytest.approx(attention_sp + gradients, rel=1e-12)


def test_etp_exchanges_the_dispatched_copies() -> None:
    layout = _layout(tp=2, dp=8, ep=8, etp=2, micro_batch=1, sequence_parallel=True)
    env = rank_envs(layout, topology_of(layout.cluster))[0]
    assert env.etp.size == 2
    cost = layer_cost(_shape(layout), env.device, FIVEFOLD, env.tp, SELF, env.ep, env.etp)
    h, e = MODEL.hidden, 2
    hidden = 4096 * h * e
    # The rank's 2048 tokens x top_k 8 copies are spread over 8 ep ranks and come back to 16 local experts;
    # the etp pair gathers both ranks' rows: 2 x 2048 x 8 rows of 2048, all-gather + reduce-scatter each way.
    rows = 2 * 2048 * 8 * h * e
    etp = 2 * (all_gather_time(rows, env.etp) + reduce_scatter_time(rows, env.etp))
    attention_sp = 2 * (all_gather_time(hidden, env.tp) + reduce_scatter_time(hidden, env.tp))
    gradients = all_reduce_time(128 * h * e, env.tp) + 3 * all_reduce_time(768 * h * e, env.tp)
    assert cost.tp_comm == pytest.approx(attention_sp + etp + gradients, rel=1e-12)


def test_plan_finds_folded_layouts_for_tiny_moe(capsys) -> None:
    for flags in (["--etp", "2"], ["--tp", "2", "--ep", "4"]):
        assert main(["plan", "--model", "tiny-moe", "--cluster", "1x4xcpu", "--top", "1", "--json", *flags]) == 0
        best = json.loads(capsys.readouterr().out)["candidates"][0]["plan"]
        assert (" etp2 " in best) if flags[0] == "--etp" else (" tp2 " in best and " ep4 " in best)


def test_host_counts_the_moe_blocks_own_tp_collectives() -> None:
    from fivefold.cost.stack import TensorParallelCollectives, tensor_parallel_collectives

    dense = PRESETS["tiny"]
    assert tensor_parallel_collectives(True, dense) == TensorParallelCollectives(4, 4, 1, 1, 2, 1)
    assert (tensor_parallel_collectives(False, dense).layer_forward,
            tensor_parallel_collectives(False, dense).layer_backward) == (2, 5)
    # MoE with one SwiGLU shared expert: SP leaves attention's 2 + 2 and the router's and 3 shared matrices'
    # gradient all-reduces; without SP attention's 1 + 3, the output's and input gradient's all-gathers.
    sp, plain = tensor_parallel_collectives(True, MODEL), tensor_parallel_collectives(False, MODEL)
    assert (sp.layer_forward, sp.layer_backward) == (2, 2 + 4)
    assert (plain.layer_forward, plain.layer_backward) == (1 + 1, 3 + 1 + 4)
