"""Context parallel in the cost model, planner and simulator: each method's communication (volume from
kv_heads, overlap with local attention, the slowest link of the cp group), the balanced causal work per rank,
the memory CP saves and what all-gather keeps; the planner searches cp_method and finds a llama3-8b plan at
sequence 131072 on 8 H100 that does not fit without cp; the simulator draws the CP exchange; the trend of
TorchTitan's long-context tables (bench/validate_cp.py writes the full table)."""

from __future__ import annotations

import importlib.util
import pathlib
from dataclasses import replace

import pytest

from fivefold.cost import STACKS
from fivefold.cost import estimate as _estimate
from fivefold.cost.comm import all_gather_time, all_to_all_time, p2p_time, topology_of
from fivefold.cost.compute import Device, flash_attention_time
from fivefold.cost.context import context_parallel_comm, context_parallel_kept_bytes
from fivefold.cost.layer import LayerShape
from fivefold.cost.memory import layer_activation_bytes, layer_transient_bytes
from fivefold.planner import Choices
from fivefold.planner import search as _search
from fivefold.planner.search import NoFeasiblePlan
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster


# These checks describe the mechanisms of the open-ended `modern` stack; the default became `fivefold` (issue 25).
def estimate(plan, stack=None, headroom: float = 0.0):  # type: ignore[no-untyped-def]
    return _estimate(plan, stack or STACKS["modern"], headroom)


def search(*args, **fields):  # type: ignore[no-untyped-def]
    return _search(*args, **{"stack": STACKS["modern"], **fields})


ROOT = pathlib.Path(__file__).resolve().parent.parent
LLAMA8B = PRESETS["llama3-8b"]
SEQ = 131072


def link(cluster: str, devices: list[int]):
    return topology_of(parse_cluster(cluster)).group_link(devices)


def test_allgather_volume_comes_from_kv_heads_and_hides_behind_local_attention():
    cp8 = link("1x8xH100-SXM", list(range(8)))
    mha = replace(LLAMA8B, kv_heads=32)
    gqa_bytes = 2 * SEQ * 8 * 128 * 2  # K and V of the whole sequence, 8 kv heads of 128, bf16
    exposed, _ = context_parallel_comm(LLAMA8B, SEQ, 1, 1, "allgather", cp8, 2, 0.0, 0.0)
    assert exposed == pytest.approx(all_gather_time(gqa_bytes, cp8))
    assert context_parallel_comm(mha, SEQ, 1, 1, "allgather", cp8, 2, 0.0, 0.0)[0] == pytest.approx(
        all_gather_time(4 * gqa_bytes, cp8))  # 4x the kv heads, 4x the bytes
    # 1/cp of the attention runs on the local chunk while the rest arrives.
    assert context_parallel_comm(LLAMA8B, SEQ, 1, 1, "allgather", cp8, 2, 8 * exposed / 2, 0.0)[0] == \
        pytest.approx(exposed / 2)
    assert context_parallel_comm(LLAMA8B, SEQ, 1, 1, "allgather", cp8, 2, 1.0, 1.0) == (0.0, 0.0)


def test_ulysses_sends_four_all_to_alls_whose_volume_per_rank_does_not_grow_with_cp():
    def ulysses(cp: int) -> float:
        return context_parallel_comm(LLAMA8B, SEQ, 1, 1, "ulysses", link("1x8xH100-SXM", list(range(cp))), 2,
                                     1.0, 1.0)[0]

    cp8 = link("1x8xH100-SXM", list(range(8)))
    tokens = SEQ // 8
    expected = 2 * all_to_all_time(tokens * 4096 * 2, cp8) + 2 * all_to_all_time(tokens * 1024 * 2, cp8)
    assert ulysses(8) == pytest.approx(expected)  # not hidden, however long the attention
    assert ulysses(8) < ulysses(2)  # each rank holds fewer tokens; all-gather's bytes stay s * kv


def test_the_slowest_link_of_the_cp_group_sets_the_time():
    inside = link("2x8xH100-SXM", [0, 1])
    across = link("2x8xH100-SXM", [0, 8])  # same size, one rank on each node: the NIC
    args = (LLAMA8B, SEQ, 1, 1, "allgather")
    assert context_parallel_comm(*args, across, 2, 0.0, 0.0)[0] > 3 * context_parallel_comm(*args, inside, 2, 0.0,
                                                                                             0.0)[0]


def test_balanced_chunks_give_each_rank_one_cp_th_of_the_causal_work():
    device = Device(parse_cluster("1x8xH100-SXM").groups[0].device, "bf16", None)
    whole = flash_attention_time(device, 32, SEQ, SEQ, 128, True, False)
    share = flash_attention_time(device, 32, SEQ // 8, SEQ, 128, True, False)
    assert share == pytest.approx(whole / 8, rel=0.03)  # the FLOPs exactly; fewer query tiles fill the SMs less


def test_cp_divides_activation_memory_and_allgather_keeps_the_gathered_kv():
    def shape(cp: int, method: str = "allgather") -> LayerShape:
        return LayerShape(LLAMA8B, 32768, 1, 1, cp, 1, False, "none", cp_method=method)

    one = layer_activation_bytes(shape(1), False, "flash", 2)
    kept = context_parallel_kept_bytes(LLAMA8B, 32768, 1, 4, "allgather", 2)
    assert kept == 2 * (32768 * 3 // 4) * 1024 * 2
    assert layer_activation_bytes(shape(4), False, "flash", 2) == pytest.approx(one / 4 + kept)
    assert layer_activation_bytes(shape(4, "ulysses"), False, "flash", 2) == pytest.approx(one / 4)


def test_torch_ring_cp_moves_heads_wide_kv_and_rotates_fp32_grads_in_backward():
    """TorchTitan's Llama repeats K/V to every query head before SDPA, and torch's experimental CP backward
    all-gathers K/V again, then passes the fp32 dK/dV around the ring, one hop per step (cost/context.py)."""
    across = link("8x8xH100-SXM", [0, 8, 16, 24, 32, 40, 48, 56])  # one rank per node, as under tp 8
    heads_bytes = 2 * SEQ * 32 * 128 * 2  # K and V repeated to the 32 query heads, bf16
    forward, backward = context_parallel_comm(LLAMA8B, SEQ, 1, 1, "allgather", across, 2, 0.0, 0.0, True, True)
    assert forward == pytest.approx(all_gather_time(heads_bytes, across))
    hop = p2p_time(2 * SEQ // 8 * 32 * 128 * 4, across)  # one chunk's dK and dV in fp32
    assert backward == pytest.approx(forward + 8 * hop)
    # Each hop hides under the next ring step's attention backward (1/cp of it); the last hides under nothing.
    _, hidden = context_parallel_comm(LLAMA8B, SEQ, 1, 1, "allgather", across, 2, 1.0, 8.0, True, True)
    assert hidden == pytest.approx(hop)


def test_a_cp_backward_that_gathers_again_keeps_no_kv_but_holds_it_while_attention_runs():
    shape = LayerShape(LLAMA8B, 32768, 1, 1, 4, 1, False, "none", cp_method="allgather")
    gathered = context_parallel_kept_bytes(LLAMA8B, 32768, 1, 4, "allgather", 2, repeated_kv=True)
    assert gathered == 4 * context_parallel_kept_bytes(LLAMA8B, 32768, 1, 4, "allgather", 2)  # 32 heads, not 8
    kept = layer_activation_bytes(shape, False, "flash", 2, cp_repeats_kv=True)
    assert layer_activation_bytes(shape, False, "flash", 2, cp_repeats_kv=True, cp_regathers=True) == \
        pytest.approx(kept - gathered)
    assert layer_transient_bytes(shape, False, "flash", 2, True, True) == pytest.approx(gathered)
    assert layer_transient_bytes(shape, False, "flash", 2) == 0.0


def test_planner_finds_a_long_context_plan_that_only_fits_with_cp():
    """llama3-8b at 131072 tokens on 8 H100 with FSDP alone (tp 1, pp 1, as TorchTitan's Table 2 runs it):
    nothing fits without cp; the search over cp and cp_method finds one."""
    train = TrainSpec(seq_len=SEQ, global_batch=8)
    cluster = parse_cluster("1x8xH100-SXM")
    with pytest.raises(NoFeasiblePlan):
        search(LLAMA8B, cluster, train, Choices(tp=1, pp=1, cp=1))
    result = search(LLAMA8B, cluster, train, Choices(tp=1, pp=1), top=10)
    best = result.candidates[0]
    assert best.plan.cp >= 2 and best.estimate.fits
    assert {c.plan.cp_method for c in result.candidates} == {"allgather", "ulysses"}  # both were searched
    only = search(LLAMA8B, cluster, train, Choices(tp=1, pp=1, cp_method="ulysses"), top=3)
    assert all(c.plan.cp_method == "ulysses" and c.plan.cp > 1 for c in only.candidates)


def test_simulator_draws_the_context_parallel_exchange():
    from fivefold.sim import simulate_plan

    plan = Plan(model=replace(LLAMA8B, layers=8), cluster=parse_cluster("2x8xH100-SXM"),
                train=TrainSpec(seq_len=8192, global_batch=8), dp=1, tp=8, cp=2, micro_batch=1, zero=1)
    result = simulate_plan(plan, estimate=estimate(plan))
    exchanges = [e for e in result.events if e.kind == "cp-exchange"]
    assert len(exchanges) == 2 * plan.num_micro_batches  # one bar in each forward and each backward
    per_micro_batch = estimate(plan).stage_costs[0].cp_comm
    assert per_micro_batch > 0
    assert sum(e.end - e.start for e in exchanges) == pytest.approx(per_micro_batch * plan.num_micro_batches)
    no_cp = simulate_plan(replace(plan, cp=1, dp=2), estimate=estimate(replace(plan, cp=1, dp=2)))
    assert not [e for e in no_cp.events if e.kind == "cp-exchange"]


@pytest.mark.skipif(not (ROOT.parent / "shared" / "reference" / "torchtitan_h100.csv").is_file()
                    and not pathlib.Path("/work/shared/reference/torchtitan_h100.csv").is_file(),
                    reason="needs shared/reference/torchtitan_h100.csv")
def test_long_context_trend_follows_torchtitan_tables_2_and_6():
    spec = importlib.util.spec_from_file_location("validate_cp", ROOT / "bench" / "validate_cp.py")
    validate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(validate)
    from fivefold.cost.stack import stack_named

    stack = stack_named("torchtitan")
    for table in ("2", "6"):
        rows = validate.rows((table,))
        predicted = [estimate(validate.plan_of(r), stack).tokens_per_s / int(r["gpus"]) for r in rows]
        measured = [float(r["tokens_per_s_per_gpu"]) for r in rows]
        assert [int(r["cp"]) for r in rows] == [1, 2, 4, 8]
        assert predicted == sorted(predicted, reverse=True)  # longer sequences, fewer tokens per second
        assert 0.9 < predicted[0] / measured[0] < 1.1  # cp1, 32K
        for p, m in zip(predicted, measured):
            assert 0.9 < p / m < 1.4, (table, p, m)
        # Trend: 32K -> 256K throughput falls 4.8x (405B) and 7.1x (8B) measured, 3.3x and 5.3x predicted: the
        # model misses a cost that grows with attention (docs/validation.md); held here so it cannot widen.
        assert 3 < predicted[0] / predicted[-1] < measured[0] / measured[-1]
        assert predicted[-1] / predicted[0] == pytest.approx(measured[-1] / measured[0], rel=0.45)


def test_a_stack_without_ulysses_says_so():
    from fivefold.cost import STACKS

    plan = Plan(model=LLAMA8B, cluster=parse_cluster("1x8xH100-SXM"), train=TrainSpec(seq_len=8192, global_batch=8),
                dp=4, cp=2, cp_method="ulysses", zero=3)
    assert "CP method ulysses" in estimate(plan, STACKS["torchtitan"]).notes[0]  # TorchTitan: all-gather only
    assert not any("cannot run" in n for n in estimate(plan, STACKS["modern"]).notes)
