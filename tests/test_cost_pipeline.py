"""Pipeline bubbles of each schedule: the closed forms against the replay of torch's action orders, and the
step-time composition the simulator replays."""

import random

import pytest

from fivefold.cost import bubble_ratio, estimate
from fivefold.cost.pipeline import critical_hops, pipeline_time, schedule_time, walk_orders, walked_pipeline
from fivefold.sim.engine import StageTimes, StepInput, simulate
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("zb-h1", 1), ("zbv", 2))


def replay(schedule: str, pp: int, virtual: int, micro_batches: int, f: float, b: float, w: float,
           hop: float = 0.0, async_p2p: bool = True) -> float:
    """The simulator's pipeline time for identical stages: torch's orders, nothing but dependencies."""
    stages = [StageTimes(f, b, w, send_activation=hop if i < pp * virtual - 1 else 0.0)
              for i in range(pp * virtual)]
    return simulate(StepInput(schedule, pp, virtual, micro_batches, tuple(stages), async_p2p=async_p2p)).pipeline_time_s


def test_textbook_bubbles():
    assert bubble_ratio("1f1b", 8, 32) == pytest.approx(7 / 32)
    assert bubble_ratio("gpipe", 8, 32) == pytest.approx(7 / 32)
    assert bubble_ratio("interleaved-1f1b", 8, 32, 4) == pytest.approx(7 / 128)
    # Qi et al. 2024: ZB-H1 (p-1)(F+B-W), a third of 1F1B's when F = B = W; ZB-V's V shape closes it.
    assert bubble_ratio("zb-h1", 8, 32, 1, 1, 1, 1) == pytest.approx(7 / 96)
    assert bubble_ratio("zbv", 8, 32, 2, 1, 1, 1) == 0.0
    assert bubble_ratio("zbv", 8, 32, 2, 1, 2, 1) == pytest.approx(7 * 1 / (2 * 32 * 4))
    assert bubble_ratio("1f1b", 1, 32) == 0.0


def test_closed_forms_by_hand():
    # 1F1B and GPipe: (m + p - 1)(f + b + w); interleaved (v m + p - 1) per chunk.
    assert schedule_time("1f1b", 4, 1, 8, 1.0, 1.0, 1.0) == pytest.approx(33.0)
    assert schedule_time("interleaved-1f1b", 4, 2, 8, 0.5, 0.5, 0.5) == pytest.approx((16 + 3) * 1.5)
    # ZB-H1, m >= p, W <= F: Qi et al.'s m(F+B+W) + (p-1)(F+B-W).
    assert schedule_time("zb-h1", 4, 1, 16, 1.0, 1.1, 0.9) == pytest.approx(16 * 3 + 3 * 1.2)
    # ZB-H1, m < p: no steady state, only the last W hides nothing: (m+p-1)(F+B) + W.
    assert schedule_time("zb-h1", 8, 1, 4, 1.0, 1.1, 0.9) == pytest.approx(11 * 2.1 + 0.9)
    # ZBV, full V: 2m(f+b+w) + (p-1) b for these ratios (the V's last input gradient drains).
    assert schedule_time("zbv", 8, 2, 32, 1.0, 1.1, 0.9) == pytest.approx(64 * 3 + 7 * 1.1)
    # ZBV, m <= p: the first micro-batch's round trip through the V, then the rank's backward work.
    assert schedule_time("zbv", 8, 2, 4, 1.0, 1.1, 0.9) == pytest.approx(16 * 2.1 + 6 * 1.1 + 8 * 0.9)


def test_zbv_never_beats_its_warm_up_lower_bound():
    """Issue: the old ZB-V bubble fell below the hard bound of p-1 chunk forwards before the last rank
    starts plus that rank's own work."""
    for p in (4, 8):
        for m in (p, 2 * p, 4 * p):
            f, b, w = 1.0, 1.1, 0.9
            assert schedule_time("zbv", p, 2, m, f, b, w) >= (p - 1) * f + m * 2 * (f + b + w)


def test_closed_forms_match_the_replay_for_any_stage_ratio():
    """Random F:B:W ratios and sizes: exact for gpipe, 1F1B, interleaved and ZB-H1; ZBV between p and 2p-1
    micro-batches (a partly filled V) is interpolated, within 5%."""
    rng = random.Random(7)
    worst = {}
    for _ in range(60):
        b, w = rng.uniform(0.7, 2.4), rng.uniform(0.3, 1.5)
        for schedule, virtual in SCHEDULES:
            p = rng.choice([2, 3, 4, 8])
            m = rng.choice([1, 2, p, 2 * p - 1, 2 * p, 4 * p])
            if schedule == "interleaved-1f1b":
                m = p * max(1, m // p)
            error = schedule_time(schedule, p, virtual, m, 1.0, b, w) / replay(schedule, p, virtual, m, 1.0, b, w) - 1
            worst[schedule] = max(worst.get(schedule, 0.0), abs(error))
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
        assert worst[schedule] < 1e-9, schedule
    assert worst["zbv"] < 0.05


def test_sends_on_the_critical_path():
    """1F1B's steady state pays the round trip to the next rank: 2(p-1)/p hops per micro-batch, plus 2(p-1)
    for fill and drain, plus 2 per micro-batch before the steady state (p=4, m=8: 6 + 4 + 6 = 16 hops)."""
    once, cycle, cycles = critical_hops("1f1b", 4, 1, 8, True)
    assert once + cycle * cycles == pytest.approx(16.0)
    assert pipeline_time("1f1b", 4, 1, 8, [(1.0, 1.0, 1.0)] * 4, 0.05, True).total == pytest.approx(
        replay("1f1b", 4, 1, 8, 1.0, 1.0, 1.0, hop=0.05))
    assert critical_hops("interleaved-1f1b", 4, 2, 8, True)[0] == 2 * (2 * 4 - 1)  # every stage boundary, twice
    for schedule, virtual in SCHEDULES:
        for m in (4, 16):
            once, cycle, cycles = critical_hops(schedule, 4, virtual, m, True)
            estimated = schedule_time(schedule, 4, virtual, m, 1.0, 1.1, 0.9) + (once + cycle * cycles) * 0.05
            assert estimated == pytest.approx(replay(schedule, 4, virtual, m, 1.0, 1.1, 0.9, 0.05), rel=0.02)


def test_pipeline_time_for_unequal_ranks():
    equal = pipeline_time("1f1b", 4, 1, 8, [(1.0, 1.0, 1.0)] * 4, hop=0.0, async_p2p=True)
    assert equal.total == pytest.approx((8 + 4 - 1) * 3.0)
    # The slow last rank runs its 4 micro-batches back to back (24), the fast one's F and B fill and drain
    # (3), and only the fill and drain hops show: the steady state is paced by the slow rank, not the
    # round trip (mean 4.5 + 0.5 < 6). The simulator gives the same 28.
    unequal = pipeline_time("1f1b", 2, 1, 4, [(1.0, 1.0, 1.0), (2.0, 2.0, 2.0)], hop=0.5, async_p2p=True)
    assert unequal.total == pytest.approx(28.0) and unequal.bubble == pytest.approx(3.0)
    stages = (StageTimes(1.0, 1.0, 1.0, send_activation=0.5), StageTimes(2.0, 2.0, 2.0))
    assert simulate(StepInput("1f1b", 2, 1, 4, stages)).pipeline_time_s == pytest.approx(28.0)
    interleaved = pipeline_time("interleaved-1f1b", 4, 2, 8, [(1.0, 1.0, 1.0)] * 4, hop=0.0, async_p2p=True)
    assert interleaved.total == pytest.approx(8 * 3 + 3 * 3 / 2)
    # Ranks sharing work are given once with their members.
    grouped = pipeline_time("1f1b", 4, 1, 8, [(1.0, 1.0, 1.0), (2.0, 1.0, 1.0)], 0.0, True, [[0, 1, 2], [3]])
    listed = pipeline_time("1f1b", 4, 1, 8, [(1.0, 1.0, 1.0)] * 3 + [(2.0, 1.0, 1.0)], 0.0, True)
    assert grouped == listed and grouped.total == pytest.approx(8 * 4 + 9)


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
        hop = max(stage.send_activation for stage in result.stage_costs)
        pipeline = pipeline_time(schedule, plan.pp, virtual, plan.num_micro_batches, [tuple(r) for r in ranks],
                                 hop, True)
        # Interleaved and ZB-V ranks whose chunks differ (here: the embedding and the LM head) walk the orders.
        stages = [(s.forward, s.backward_input, s.backward_weight, s.send_activation) for s in result.stage_costs]
        walked = walked_pipeline(pipeline, schedule, plan.pp, virtual, plan.num_micro_batches, stages,
                                 [s.pp_rank for s in result.stage_costs])
        assert (walked is pipeline) == (schedule not in ("interleaved-1f1b", "zbv"))
        assert result.pipeline_s == pytest.approx(walked.total, rel=1e-12)
        if walked is not pipeline:
            assert walked.total == pytest.approx(walk_orders(schedule, plan.pp, virtual, plan.num_micro_batches,
                                                             stages), rel=1e-12)
        assert result.step_time_s == pytest.approx(walked.total + result.dp_comm_exposed_s + result.optimizer_s,
                                                   rel=1e-12)
        assert sum(result.breakdown_s.values()) == pytest.approx(result.step_time_s, rel=1e-9)
