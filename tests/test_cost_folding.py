"""MoE parallel folding, expert tensor parallel and Megatron-FSDP in the cost model, planner and simulator
(issues 25 and 26): ep folded over tp x cp x dp, etp splitting each expert, the groups each one costs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fivefold.cli import main
from fivefold.cost import STACKS, Layout, estimate
from fivefold.cost.comm import topology_of
from fivefold.cost.layout import rank_envs
from fivefold.cost.moe_block import moe_tokens
from fivefold.planner import Choices, search
from fivefold.sim import simulate_plan
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

QWEN = PRESETS["qwen3-30b-a3b"]
CORE = STACKS["megatron-core"]
TRAIN = TrainSpec(seq_len=4096, global_batch=64)


def _plan(**fields) -> Plan:
    return Plan(model=QWEN, cluster=parse_cluster("2x8xH100-SXM"), train=TRAIN, zero=1,
                **{"sequence_parallel": fields.get("tp", 1) > 1, **fields})


def test_tokens_and_expert_split_follow_the_folding() -> None:
    # tp2 with SP: a rank holds and routes half of its tp group's 4096 tokens; with etp 2 (Megatron's default,
    # experts split like the MLP) the etp pair gathers the received copies after the dispatch, etp 1 keeps the
    # experts whole. (routed, gathered after dispatch, expert split, shared-expert split)
    assert moe_tokens(4096, 2, 2, True, False) == (2048, 2, 2, 1)
    assert moe_tokens(4096, 2, 1, True, False) == (2048, 1, 1, 1)
    assert moe_tokens(4096, 1, 1, False, False) == (4096, 1, 1, 1)
    assert moe_tokens(4096, 2, 1, False, False) == (4096, 1, 1, 1)  # Megatron without SP: every rank, all
    # fivefold's runtime: each tp rank routes its own half with or without SP; etp gathers the dispatched copies.
    assert moe_tokens(4096, 2, 2, True, True) == (2048, 2, 2, 1)
    assert moe_tokens(4096, 2, 1, False, True) == (2048, 1, 1, 1)


def test_ep_spanning_tp_costs_its_own_groups() -> None:
    # 16 GPUs, tp2 dp8: ep16 needs the tp ranks too (dp x cp = 8); edp = 16 / (16 x 1) = 1.
    spanning = _plan(tp=2, dp=8, ep=16)
    env = rank_envs(Layout.of_plan(spanning), topology_of(spanning.cluster))[0]
    assert env.ep.size == 16 and env.ep.nodes == 2 and env.expert_replicas.size == 1 and env.etp.size == 1
    split = _plan(tp=2, dp=8, ep=8, etp=2)
    env = rank_envs(Layout.of_plan(split), topology_of(split.cluster))[0]
    assert env.ep.size == 8 and env.etp.size == 2 and env.etp.nodes == 1 and env.expert_replicas.size == 1
    whole, tp_split = estimate(spanning, CORE), estimate(split, CORE)
    # Both fit and differ: etp 2 gathers twice the tokens per rank for the same all-to-all group size.
    assert whole.step_time_s != pytest.approx(tp_split.step_time_s, rel=1e-3)
    assert tp_split.breakdown_s["tp_comm"] > whole.breakdown_s["tp_comm"]  # etp's gather / reduce-scatter
    # Expert states: each rank holds experts / (ep x etp) of them.
    assert whole.stage_costs[0].static_bytes == pytest.approx(tp_split.stage_costs[0].static_bytes, rel=0.05)
    assert not any("cannot run" in note for note in whole.notes)
    assert not any("cannot run" in note for note in estimate(spanning, STACKS["fivefold"]).notes)


def test_megatron_core_plans_with_fsdp_and_with_ep_over_tp(capsys) -> None:
    assert main(["plan", "--model", "llama3-8b", "--cluster", "1x8xH100-SXM", "--seq-len", "8192",
                 "--global-batch", "16", "--stack", "megatron-core", "--zero", "3", "--top", "1", "--json"]) == 0
    assert " zero3 " in json.loads(capsys.readouterr().out)["candidates"][0]["plan"]
    assert main(["plan", "--model", "qwen3-235b-a22b", "--cluster", "32x8xH100-SXM", "--seq-len", "4096",
                 "--global-batch", "1024", "--stack", "megatron-core", "--tp", "2", "--ep", "32", "--top", "1",
                 "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["candidates"][0]["plan"]
    assert " tp2 " in best and " ep32 " in best
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "megatron-core: parallel dp/tp/pp/cp/ep; schedules 1f1b, interleaved-1f1b; ZeRO 0/1/3; MoE folding" in text


def test_the_search_covers_etp_and_ep_spanning_tp() -> None:
    model = replace(QWEN, layers=4)
    found = search(model, parse_cluster("2x8xH100-SXM"), TRAIN, Choices(tp=2, pp=1, cp=1), stack=CORE, top=50)
    layouts = {(c.plan.ep, c.plan.etp) for c in found.candidates}
    assert any(ep > 8 for ep, _ in layouts)  # ep beyond dp x cp = 8: spanning tp
    fixed = search(model, parse_cluster("2x8xH100-SXM"), TRAIN, Choices(tp=2, pp=1, cp=1, etp=2), stack=CORE, top=5)
    assert {c.plan.etp for c in fixed.candidates} == {2}
    # fivefold's runtime folds too (runtime/expert_folding.py): the same layouts are searched.
    own = search(model, parse_cluster("2x8xH100-SXM"), TRAIN, Choices(tp=2, pp=1, cp=1), stack=STACKS["fivefold"],
                 top=200)
    assert any(c.plan.ep > 8 for c in own.candidates) and {c.plan.etp for c in own.candidates} == {1, 2}


def test_simulator_replays_a_folded_plan() -> None:
    plan = _plan(tp=2, dp=8, ep=16, micro_batch=1)
    predicted = estimate(plan, CORE)
    simulated = simulate_plan(plan, estimate=predicted)
    assert simulated.step_time_s == pytest.approx(predicted.step_time_s, rel=0.03)
