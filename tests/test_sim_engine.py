"""The event-driven engine against closed forms, published bubble rates and hand-computed timelines."""

from __future__ import annotations

import pytest

from fivefold.errors import SpecError
from fivefold.sim.engine import (GRAD_REDUCE, OPTIMIZER, PARAM_GATHER, StageTimes, StepInput, simulate,
                                 simulate_replicas)


def uniform(schedule: str, pp: int, virtual: int, micro_batches: int, forward: float = 1.0,
            backward_input: float = 1.0, backward_weight: float = 1.0, **extra) -> StepInput:
    """Every virtual stage holds 1/virtual of a rank's work (so rank totals do not depend on virtual)."""
    stage = StageTimes(forward / virtual, backward_input / virtual, backward_weight / virtual, **extra)
    return StepInput(schedule, pp, virtual, micro_batches, (stage,) * (pp * virtual))


GRID = [(p, m) for p in (2, 4, 8) for m in (4, 8, 16, 32) if m >= p]


@pytest.mark.parametrize("pp,micro_batches", GRID)
def test_1f1b_and_gpipe_bubble_is_p_minus_1_over_m(pp: int, micro_batches: int) -> None:
    for schedule in ("1f1b", "gpipe"):
        result = simulate(uniform(schedule, pp, 1, micro_batches))
        assert result.bubble_fraction == pytest.approx((pp - 1) / micro_batches, rel=1e-9)
        for rank in result.ranks:  # every rank waits the same (p-1)(F+B) in total
            assert rank.bubble_fraction == pytest.approx((pp - 1) / micro_batches, rel=1e-9)


@pytest.mark.parametrize("pp,micro_batches", [(p, m) for p, m in GRID if m % p == 0])
@pytest.mark.parametrize("virtual", [2, 4])
def test_interleaved_bubble_is_p_minus_1_over_vm(pp: int, micro_batches: int, virtual: int) -> None:
    result = simulate(uniform("interleaved-1f1b", pp, virtual, micro_batches))
    assert result.bubble_fraction == pytest.approx((pp - 1) / (virtual * micro_batches), rel=1e-9)


def own_span_bubble(result, micro_batches: int, rank_work: float) -> float:
    """Bubble as Qi et al. 2024 count it: idle time inside each rank's own first-to-last action, worst rank,
    over the ideal m(T_F+T_B+T_W). (With their optimizer post-validation a rank starts its next step as soon
    as its own step ends, so the stagger between ranks' start times does not repeat.)"""
    worst = 0.0
    for rank in result.ranks:
        mine = [e for e in result.events if e.rank == rank.rank and e.lane == "compute"]
        span = max(e.end for e in mine) - min(e.start for e in mine)
        worst = max(worst, span - sum(e.end - e.start for e in mine))
    return worst / (micro_batches * rank_work)


@pytest.mark.parametrize("pp,micro_batches", GRID)
def test_zero_bubble_rates_of_the_paper(pp: int, micro_batches: int) -> None:
    """github.com/sail-sg/zero-bubble-pipeline-parallelism README (Qi et al. 2024), T_F = T_B = T_W:
    bubble rate 1F1B (p-1)/m, ZB-H1 ("ZB1P") (p-1)/3m, ZBV 0."""
    one_f_one_b = simulate(uniform("1f1b", pp, 1, micro_batches))
    zb_h1 = simulate(uniform("zb-h1", pp, 1, micro_batches))
    zbv = simulate(uniform("zbv", pp, 2, micro_batches))
    assert own_span_bubble(one_f_one_b, micro_batches, 3.0) == pytest.approx((pp - 1) / micro_batches)
    assert own_span_bubble(zb_h1, micro_batches, 3.0) == pytest.approx((pp - 1) / (3 * micro_batches))
    # Measured from the common start instead, ZB-H1 is the same.
    assert zb_h1.bubble_fraction == pytest.approx((pp - 1) / (3 * micro_batches))
    if micro_batches >= 2 * pp - 1:  # ZBV fills its V only with 2p-1 micro-batches or more
        assert own_span_bubble(zbv, micro_batches, 3.0) == pytest.approx(0.0, abs=1e-12)
        # From the common start ZBV keeps the (p-1) chunk forwards of its warm-up: (p-1) T_F/2 over 3 m T.
        assert zbv.bubble_fraction == pytest.approx((pp - 1) / (6 * micro_batches))
    else:
        assert own_span_bubble(zbv, micro_batches, 3.0) > 0


@pytest.mark.parametrize("forward,backward_input,backward_weight", [(1.0, 1.2, 0.8), (1.0, 1.5, 0.6),
                                                                    (1.0, 2.0, 1.0), (1.0, 1.0, 0.3)])
@pytest.mark.parametrize("pp", [4, 8])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(pp: int, forward: float, backward_input: float,
                                                          backward_weight: float) -> None:
    """Qi et al. 2024, section 2.1: ZB-H1 bubble (p-1)(T_F + T_B - T_W), 1F1B (p-1)(T_F + T_B + T_W)."""
    micro_batches = 4 * pp
    times = dict(forward=forward, backward_input=backward_input, backward_weight=backward_weight)
    ideal = micro_batches * (forward + backward_input + backward_weight)
    zb_h1 = simulate(uniform("zb-h1", pp, 1, micro_batches, **times))
    one_f_one_b = simulate(uniform("1f1b", pp, 1, micro_batches, **times))
    assert zb_h1.pipeline_time_s - ideal == pytest.approx((pp - 1) * (forward + backward_input - backward_weight))
    assert one_f_one_b.pipeline_time_s - ideal == pytest.approx((pp - 1) * (forward + backward_input
                                                                             + backward_weight))


def test_peak_activation_memory_per_schedule() -> None:
    """In-flight micro-batches: 1F1B rank r holds min(p - r, m) (Narayanan et al. 2021); GPipe m; ZB-H1 and ZB-V
    at most p stage-activations (Qi et al. 2024, Table 2 and section 6); interleaved rank 0 holds
    p(1 + (p-1)/(p v)) (Korthikanti et al. 2022, section 4.2.3)."""
    pp, micro_batches, static = 4, 16, 100.0

    def peaks(schedule: str, virtual: int) -> list[float]:
        step = uniform(schedule, pp, virtual, micro_batches, activation_bytes=1.0 / virtual, static_bytes=static)
        return [r.peak_memory_bytes - static * virtual for r in simulate(step).ranks]

    assert peaks("1f1b", 1) == [4.0, 3.0, 2.0, 1.0]
    assert peaks("gpipe", 1) == [16.0] * 4
    assert max(peaks("zb-h1", 1)) == 4.0
    assert max(peaks("zbv", 2)) == 4.0
    assert peaks("interleaved-1f1b", 2)[0] == pytest.approx(pp * (1 + (pp - 1) / (pp * 2)))


def test_slow_stage_sets_the_pace_and_the_others_wait() -> None:
    """1F1B, p=4, m=8, F=1, B=2, stage 1 twice as slow (F=2, B=4). By hand: stage 1 starts at t=1 (after stage
    0's F0), runs its 3 warm-up forwards until t=7, waits until t=9 for B0 (stages 2, 3 need 1+1+2+2 after its
    F0 ends at 3), then never idles again: 8 x 6 busy. Stage 0 adds its last B (2): 1 + 48 + 2 + 2 = 53."""
    fast, slow = StageTimes(1.0, 2.0, 0.0), StageTimes(2.0, 4.0, 0.0)
    result = simulate(StepInput("1f1b", 4, 1, 8, (fast, slow, fast, fast)))
    assert result.step_time_s == pytest.approx(53.0)
    slow_rank = result.ranks[1]
    assert slow_rank.idle_s == pytest.approx(53.0 - 48.0)
    assert all(r.idle_s == pytest.approx(53.0 - 24.0) for i, r in enumerate(result.ranks) if i != 1)
    # In the steady state the last rank gets a new micro-batch every 6 s: the slow stage's F + B.
    last_forwards = [e.start for e in result.events if e.rank == 3 and e.kind == "F"]
    assert [b - a for a, b in zip(last_forwards[3:], last_forwards[4:])] == pytest.approx([6.0] * 4)


def test_point_to_point_sends_sit_on_the_critical_path() -> None:
    """p=2, m=1, F=1, B=2, send 0.25: F0 [0,1], ship [1,1.25], F1 [1.25,2.25], B1 [2.25,4.25], ship back,
    B0 [4.5, 6.5]."""
    result = simulate(uniform("1f1b", 2, 1, 1, forward=1.0, backward_input=2.0, backward_weight=0.0,
                              send_activation=0.25))
    assert result.step_time_s == pytest.approx(6.5)
    sends = [(e.kind, e.rank, e.peer, e.start, e.end) for e in result.events if e.lane == "comm"]
    assert sends == [("send-activation", 0, 1, 1.0, 1.25), ("send-gradient", 1, 0, 4.25, 4.5)]
    # m=2: asynchronous sends let rank 0 run F1 at [1,2] while F0's activation travels; B1 on rank 0 ends at
    # 9.5. Blocking sends (an older stack) hold each sender for its send: rank 0's F1 runs [1.25,2.25],
    # rank 1's F1 waits for its gradient send [4.25,4.5], and the step ends at 9.75.
    times = dict(forward=1.0, backward_input=2.0, backward_weight=0.0, send_activation=0.25)
    assert simulate(uniform("1f1b", 2, 1, 2, **times)).step_time_s == pytest.approx(9.5)
    blocking = simulate(StepInput("1f1b", 2, 1, 2, uniform("1f1b", 2, 1, 2, **times).stages, async_p2p=False))
    assert blocking.step_time_s == pytest.approx(9.75)


def test_gradient_reduce_overlaps_the_last_backward() -> None:
    """pp=1, m=2, F=1, B=2 (I=1.5, W=0.5), 4 buckets, reduce 1, optimizer 0.5. The last B runs [4,6]; its
    first bucket is ready at 4.5, so the reduce runs [4.5,5.5] but its last bucket (0.25) only starts at 6:
    it ends at 6.25, then the optimizer: 6.75. Only 0.25 of the reduce is exposed."""
    stage = StageTimes(1.0, 1.5, 0.5, grad_reduce=1.0, buckets=4)
    result = simulate(StepInput("1f1b", 1, 1, 2, (stage,), optimizer=(0.5,)))
    reduce = next(e for e in result.events if e.kind == GRAD_REDUCE)
    assert (reduce.start, reduce.end) == (4.5, 6.25)
    optimizer = next(e for e in result.events if e.kind == OPTIMIZER)
    assert (optimizer.start, optimizer.end) == (6.25, 6.75)
    assert result.step_time_s == 6.75
    assert result.ranks[0].exposed_comm_s == pytest.approx(0.25)
    # A reduce longer than the backward is exposed by the difference.
    long_reduce = StageTimes(1.0, 1.5, 0.5, grad_reduce=3.0, buckets=4)
    assert simulate(StepInput("1f1b", 1, 1, 2, (long_reduce,))).step_time_s == pytest.approx(4.5 + 3.0)


def test_zero1_gathers_once_under_the_first_forward() -> None:
    """pp=2, v=2 interleaved, gather 0.8 per stage over 4 layers, F=B=1 (per stage). Rank 0 gathers stage 0
    [0, 0.8]; F0 of stage 0 starts after the first layer's share (0.2) and cannot end before the gather
    plus one layer of compute: [0.2, 1.2]. Stage 2's gather follows on the same stream [0.8, 1.6]."""
    stage = StageTimes(1.0, 1.0, 0.0, param_gather=0.8, buckets=4)
    result = simulate(StepInput("interleaved-1f1b", 2, 2, 2, (stage,) * 4))
    gathers = [(e.rank, e.stage, e.start, e.end) for e in result.events if e.kind == PARAM_GATHER]
    assert gathers[:2] == [(0, 0, 0.0, 0.8), (0, 2, 0.8, pytest.approx(1.6))]
    assert len(gathers) == 4  # once per stage per step
    first = next(e for e in result.events if e.kind == "F" and e.stage == 0 and e.micro_batch == 0)
    assert (first.start, first.end) == (0.2, 1.2)


def test_zero3_gathers_before_every_pass_and_reduces_after_every_backward() -> None:
    """pp=1, m=2, F=1, B=2 over 2 layers; gather 1.0 before every F and B, reduce-scatter 0.5 after every B,
    all on one communicator. F0: gather [0,1], starts after the first layer (0.5), ends max(1.5, 1+0.5).
    B0: gather [1.5,2.5], runs [2,4]; its reduce starts with the second bucket (3.0), ends max(3.5, 4+0.25).
    F1's gather queues behind that reduce: [4.25,5.25], F1 [4.75,5.75]. B1: gather [5.75,6.75], B1
    [6.25,8.25]; reduce [7.25, 8.5]: the step ends at 8.5."""
    stage = StageTimes(1.0, 2.0, 0.0, grad_reduce=0.5, reduce_every_micro_batch=True, param_gather=1.0,
                       reshard_after_forward=True, reshard_after_backward=True, buckets=2)
    result = simulate(StepInput("1f1b", 1, 1, 2, (stage,)))
    compute = [(e.kind, e.start, e.end) for e in result.events if e.lane == "compute"]
    assert compute == [("F", 0.5, 1.5), ("B", 2.0, 4.0), ("F", 4.75, 5.75), ("B", 6.25, 8.25)]
    collectives = [(e.kind, e.start, e.end) for e in result.events if e.lane == "comm"]
    assert collectives == [("param-gather", 0.0, 1.0), ("param-gather", 1.5, 2.5), ("grad-reduce", 3.0, 4.25),
                           ("param-gather", 4.25, 5.25), ("param-gather", 5.75, 6.75), ("grad-reduce", 7.25, 8.5)]
    assert result.step_time_s == 8.5
    # Without overlap (an older stack): every pass waits for its whole gather, reductions block the rank.
    blocking = simulate(StepInput("1f1b", 1, 1, 2, (stage,), overlap_grad_reduce=False, overlap_param_gather=False))
    compute = [(e.kind, e.start, e.end) for e in blocking.events if e.lane == "compute"]
    assert compute == [("F", 1.0, 2.0), ("B", 3.0, 5.0), ("F", 6.5, 7.5), ("B", 8.5, 10.5)]
    assert blocking.step_time_s == 11.0


def test_weights_kept_gathered_after_backward_are_not_gathered_again() -> None:
    """torch.distributed.pipelining with FSDP2 ZeRO-3 (reshard after forward only, gradients reduced once):
    pp=1, m=2, F=1, B=2 over 2 layers, gather 1.0. F0 gathers [0,1] and runs [0.5,1.5]; B0 finds the weights
    freed by F0 and gathers [1.5,2.5], runs [2,4]; F1 finds them still gathered: [4,5]; B1 gathers [5,6] and
    runs [5.5,7.5]. With ZeRO-2 freeing after backward instead, only the forwards gather."""
    kept = StageTimes(1.0, 2.0, 0.0, param_gather=1.0, reshard_after_forward=True, buckets=2)
    result = simulate(StepInput("1f1b", 1, 1, 2, (kept,)))
    compute = [(e.kind, e.start, e.end) for e in result.events if e.lane == "compute"]
    assert compute == [("F", 0.5, 1.5), ("B", 2.0, 4.0), ("F", 4.0, 5.0), ("B", 5.5, 7.5)]
    gathers = [(e.kind, e.start, e.end) for e in result.events if e.kind == PARAM_GATHER]
    assert [(g[1], g[2]) for g in gathers] == [(0.0, 1.0), (1.5, 2.5), (5.0, 6.0)]
    zero2 = StageTimes(1.0, 2.0, 0.0, param_gather=1.0, reshard_after_backward=True, buckets=2)
    result = simulate(StepInput("1f1b", 1, 1, 2, (zero2,)))
    gathered = [e.micro_batch for e in result.events if e.kind == PARAM_GATHER]
    compute = [(e.kind, e.start, e.end) for e in result.events if e.lane == "compute"]
    assert gathered == [0, 1] and compute == [("F", 0.5, 1.5), ("B", 1.5, 3.5), ("F", 4.0, 5.0), ("B", 5.0, 7.0)]


def test_tied_embedding_all_reduce_waits_for_both_ends() -> None:
    stage = StageTimes(1.0, 2.0, 0.0)
    result = simulate(StepInput("1f1b", 2, 1, 2, (stage, stage), optimizer=(0.5, 0.5), tied_embedding_sync=0.25))
    pipeline_end = result.pipeline_time_s  # rank 0 ends last: both wait until then
    syncs = [(e.rank, e.start, e.end) for e in result.events if e.kind == "embedding-sync"]
    assert syncs == [(0, pipeline_end, pipeline_end + 0.25), (1, pipeline_end, pipeline_end + 0.25)]
    assert result.step_time_s == pytest.approx(pipeline_end + 0.25 + 0.5)


def test_bad_input_is_a_one_line_error() -> None:
    with pytest.raises(SpecError, match="needs one StageTimes per virtual stage"):
        simulate(StepInput("1f1b", 2, 1, 4, (StageTimes(1.0, 1.0, 0.0),)))
    with pytest.raises(SpecError, match=r"stages\[0\].forward"):
        simulate(StepInput("1f1b", 1, 1, 4, (StageTimes(-1.0, 1.0, 0.0),)))


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1),
                                              ("zbv", 2)])
def test_engine_is_event_driven_and_linear_in_actions(schedule: str, virtual: int) -> None:
    """Each action is looked at a constant number of times (offered, woken at most once, popped): at most 3
    visits per action, and doubling the micro-batches at most doubles the visits. Counted, not timed, so a
    busy machine cannot make it flaky; the polling engine this replaced looked at ~60 heads per action at
    pp=64."""
    stage = StageTimes(1.0 / virtual, 1.0 / virtual, 0.5 / virtual, send_activation=0.01, grad_reduce=0.2)
    visits = []
    for micro_batches in (32, 64, 128):
        result = simulate(StepInput(schedule, 8, virtual, micro_batches, (stage,) * (8 * virtual)))
        passes = 3 if schedule in ("zb-h1", "zbv") else 2
        assert result.actions == 8 * virtual * micro_batches * passes
        assert 2 * result.actions <= result.visits <= 3 * result.actions
        visits.append(result.visits)
    assert visits[1] <= 2 * visits[0] and visits[2] <= 2 * visits[1]


def test_two_replicas_share_each_gradient_reduction_and_the_slowest_ends_the_step() -> None:
    """pp=2 1F1B, F=1, B=2 per stage, one overlapped reduction of 1 s per stage after its last B, optimizer
    0.5. By hand: replica A (2 micro-batches) ends its last B on rank 1 at 7 and on rank 0 at 9; replica B
    (3 micro-batches) at 10 and 12. Each reduction is one collective over both replicas: stage 1's runs
    [10, 11], stage 0's [12, 13] on both; the optimizer starts at 13 everywhere: step 13.5. Alone, A would
    end at 10.5."""
    stage = StageTimes(1.0, 2.0, 0.0, grad_reduce=1.0)
    replica_a = StepInput("1f1b", 2, 1, 2, (stage, stage), optimizer=(0.5, 0.5))
    replica_b = StepInput("1f1b", 2, 1, 3, (stage, stage), optimizer=(0.5, 0.5))
    assert simulate(replica_a).step_time_s == 10.5
    result = simulate_replicas([replica_a, replica_b])
    assert result.replicas == 2 and [r.rank for r in result.ranks] == [0, 1, 2, 3]
    reductions = [(e.rank, e.stage, e.start, e.end) for e in result.events if e.kind == GRAD_REDUCE]
    assert reductions == [(0, 0, 12.0, 13.0), (1, 1, 10.0, 11.0), (2, 0, 12.0, 13.0), (3, 1, 10.0, 11.0)]
    compute_a = [(e.rank, e.kind, e.micro_batch, e.start, e.end) for e in result.events
                 if e.rank < 2 and e.kind in "FB"]
    assert compute_a == [(0, "F", 0, 0.0, 1.0), (0, "F", 1, 1.0, 2.0), (0, "B", 0, 4.0, 6.0), (0, "B", 1, 7.0, 9.0),
                         (1, "F", 0, 1.0, 2.0), (1, "B", 0, 2.0, 4.0), (1, "F", 1, 4.0, 5.0), (1, "B", 1, 5.0, 7.0)]
    last_b = [e.end for e in result.events if e.rank == 2 and e.kind == "B"]
    assert last_b == [6.0, 9.0, 12.0]
    optimizers = [(e.rank, e.start, e.end) for e in result.events if e.kind == OPTIMIZER]
    assert optimizers == [(row, 13.0, 13.5) for row in range(4)]
    assert result.step_time_s == 13.5
    # Replica A's rank 0: busy 6 (F, F, B, B) + 0.5 optimizer, its reduction 1, idle the rest (waiting on B).
    assert result.ranks[0].busy_s == 6.5 and result.ranks[0].idle_s == pytest.approx(13.5 - 7.5)
