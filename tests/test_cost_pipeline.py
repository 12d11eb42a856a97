"""Pipeline bubbles of each schedule, and the step-time composition the simulator replays."""

import pytest

from fivefold.cost import bubble_ratio, estimate
from fivefold.cost.pipeline import pipeline_time
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster


def test_textbook_bubbles():
    assert bubble_ratio("1f1b", 8, 32) == pytest.approx(7 / 32)
    assert bubble_ratio("gpipe", 8, 32) == pytest.approx(7 / 32)
    assert bubble_ratio("interleaved-1f1b", 8, 32, 4) == pytest.approx(7 / 128)
    # Qi et al. 2024: ZB-H1 (p-1)(F+B-W), a third of 1F1B's when F = B = W; ZB-V's V shape closes it.
    assert bubble_ratio("zb-h1", 8, 32, 1, 1, 1, 1) == pytest.approx(7 / 96)
    assert bubble_ratio("zbv", 8, 32, 2, 1, 1, 1) == 0.0
    assert bubble_ratio("zbv", 8, 32, 2, 1, 2, 1) == pytest.approx(7 * 1 / (2 * 32 * 4))
    assert bubble_ratio("1f1b", 1, 32) == 0.0


def test_pipeline_time_for_equal_and_unequal_stages():
    equal = pipeline_time("1f1b", 4, 1, 8, [(1.0, 1.0, 1.0)] * 4, hop=0.0, async_p2p=True)
    assert equal.total == pytest.approx((8 + 4 - 1) * 3.0)  # (m + p - 1) w
    unequal = pipeline_time("1f1b", 2, 1, 4, [(1.0, 1.0, 1.0), (2.0, 2.0, 2.0)], hop=0.5, async_p2p=True)
    # m * max w + (sum w - max w) + 2 (p-1) hops = 4*6 + 3 + 1
    assert unequal.total == pytest.approx(28.0) and unequal.bubble == pytest.approx(3.0)
    blocking = pipeline_time("1f1b", 2, 1, 4, [(1.0, 1.0, 1.0), (2.0, 2.0, 2.0)], hop=0.5, async_p2p=False)
    assert blocking.total == pytest.approx(28.0 + 2 * 3 * 0.5)
    interleaved = pipeline_time("interleaved-1f1b", 4, 2, 8, [(1.0, 1.0, 1.0)] * 4, hop=0.0, async_p2p=True)
    assert interleaved.total == pytest.approx(8 * 3 + 3 * 3 / 2)


def test_larger_pipeline_never_lowers_the_1f1b_bubble_at_fixed_micro_batches():
    for m in (4, 16, 64):
        ratios = [bubble_ratio("1f1b", p, m) for p in range(1, 17)]
        assert ratios == sorted(ratios)
    # The same through the full cost model: 16 GPUs, m = 8 micro-batches per replica for every pp.
    model, cluster = PRESETS["llama3-8b"], parse_cluster("2x8xH100-SXM")
    train = TrainSpec(seq_len=2048, global_batch=128)
    fractions = []
    for pp in (1, 2, 4, 8):
        plan = Plan(model=model, cluster=cluster, train=train, pp=pp, dp=16 // pp, micro_batch=pp, zero=1)
        assert plan.num_micro_batches == 8
        fractions.append(estimate(plan).bubble_fraction)
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] > 0.2


def test_step_time_is_composed_from_stage_costs_as_documented():
    """The simulator's contract: rebuild step_time_s from Estimate.stage_costs and the per-step terms."""
    model, cluster = PRESETS["llama3-70b"], parse_cluster("4x8xH100-SXM")
    train = TrainSpec(seq_len=4096, global_batch=64)
    for schedule, virtual in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2), ("gpipe", 1)):
        plan = Plan(model=model, cluster=cluster, train=train, tp=8, pp=4, micro_batch=1, schedule=schedule,
                    virtual_stages=virtual, sequence_parallel=True, recompute="full")
        result = estimate(plan)
        ranks = [[0.0, 0.0, 0.0] for _ in range(plan.pp)]
        for index, stage in enumerate(result.stage_costs):
            assert stage.pp_rank == plan.stage_owner(index)
            ranks[stage.pp_rank][0] += stage.forward
            ranks[stage.pp_rank][1] += stage.backward_input
            ranks[stage.pp_rank][2] += stage.backward_weight
        work = [sum(r) for r in ranks]
        fill_drain = sum(work) - max(work)
        factor = {"interleaved-1f1b": 1 / virtual}.get(schedule, 1.0)
        if schedule in ("zb-h1", "zbv"):
            f, b, w = (sum(r[i] for r in ranks) for i in range(3))
            factor = bubble_ratio(schedule, plan.pp, 1, virtual, f, b, w) / bubble_ratio("1f1b", plan.pp, 1)
        hop = max(stage.send_activation for stage in result.stage_costs)
        pipeline = plan.num_micro_batches * max(work) + fill_drain * factor + 2 * (plan.pp - 1) * hop
        assert result.pipeline_s == pytest.approx(pipeline, rel=1e-12)
        assert result.step_time_s == pytest.approx(pipeline + result.dp_comm_exposed_s + result.optimizer_s,
                                                   rel=1e-12)
