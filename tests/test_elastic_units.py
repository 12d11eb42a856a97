"""fivefold.elastic without worker processes: the loss guard's decisions, the straggler rule, re-planning
for another world size, the recovery report's arithmetic and the flag checks."""

from __future__ import annotations

import json
import math

import pytest

from fivefold.cli import main
from fivefold.elastic.events import LAUNCHER, EventLog
from fivefold.elastic.guard import LossGuard, injected_loss_factors
from fivefold.elastic.hang import hang_point, is_collective_timeout
from fivefold.elastic.replan import replan_for_world
from fivefold.elastic.report import build_report, render_report
from fivefold.elastic.stragglers import StragglerWatch, describe_straggler
from fivefold.errors import SpecError
from fivefold.planner import Choices
from fivefold.runtime.launch import check_runnable
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster


def test_guard_skips_nan_inf_and_spikes_and_asks_for_rollback_after_k_in_a_row():
    guard = LossGuard(max_loss_spike=3.0, max_bad_steps=3)
    for position, loss in ((0, 5.0), (8, 4.0), (16, 3.0)):
        verdict = guard.judge(loss, 1.0)
        assert not verdict.bad
        guard.record(verdict, loss, position)
    # running median of 5, 4, 3 is 4: 12 is exactly 3x (allowed), 12.1 is not
    assert not guard.judge(12.0, 1.0).bad
    assert guard.judge(12.1, 1.0).reason == "loss 12.1 is 3.0x the running median 4 (limit 3x)"
    assert guard.judge(math.nan, 1.0).reason == "loss is nan"
    assert guard.judge(3.0, math.inf).reason == "gradient norm is inf"
    for position in (24, 32):
        guard.record(guard.judge(math.nan, 1.0), math.nan, position)
    assert guard.bad_in_a_row == 2 and not guard.should_roll_back
    guard.record(guard.judge(2.5, 1.0), 2.5, 40)  # a good step ends the streak
    assert guard.bad_in_a_row == 0 and guard.bad_positions == {24, 32}
    for position in (48, 56, 64):
        guard.record(guard.judge(100.0, 1.0), 100.0, position)
    assert guard.should_roll_back and guard.pending == [48, 56, 64]
    guard.rolled_back()
    assert not guard.should_roll_back and guard.bad_positions == {24, 32, 48, 56, 64}
    assert not LossGuard(max_loss_spike=0).judge(1e9, 1.0).bad  # 0 disables spikes, not NaN checks


def test_injection_knob_parses_and_rejects_bad_text():
    factors = injected_loss_factors("3:nan, 4:inf,7:x50")
    assert math.isnan(factors[3]) and factors[4] == math.inf and factors[7] == 50.0
    with pytest.raises(SpecError, match="FIVEFOLD_INJECT_LOSS='3:7'"):
        injected_loss_factors("3:7")
    assert hang_point("1:4") == (1, 4) and hang_point("") is None
    with pytest.raises(SpecError, match="write RANK:STEP"):
        hang_point("x")
    assert is_collective_timeout(RuntimeError("[gloo] Timed out waiting 3000ms for recv operation to complete"))
    assert not is_collective_timeout(RuntimeError("timed out connecting: Connection refused"))


def test_straggler_needs_patience_and_uses_the_low_median():
    watch = StragglerWatch(factor=1.5, patience=3, hosts=["a", "b"])
    assert watch.observe(1, [1.0, 3.0]) == [] and watch.observe(2, [1.0, 3.2]) == []
    assert watch.observe(3, [1.0, 1.2]) == []  # streak broken
    found = [watch.observe(step, [1.0, 2.0]) for step in (4, 5, 6, 7)]
    assert found[:2] == [[], []] and found[3] == []  # reported once
    assert found[2] == [{"rank": 1, "host": "b", "since_step": 4, "steps": 3, "ratio": 2.0, "factor": 1.5}]
    assert describe_straggler(found[2][0]) == ("straggler: rank 1 on host b computes 2.0x slower than the median "
                                               "rank for 3 steps in a row (since step 4; limit 1.5x)")


def test_replan_keeps_the_global_batch_and_the_micro_batch():
    plan = Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x4xcpu"),
                train=TrainSpec(seq_len=32, global_batch=16, dtype="fp32"), dp=2, pp=2, micro_batch=2)
    shrunk, line = replan_for_world(plan, 2, Choices(pp=2), lambda p: check_runnable(p, 2, "cpu", 0))
    assert line == ("world size 4 -> 2: re-planned dp2 pp2 -> dp1 pp2 (more accumulation: 4 -> 8 micro-batches), "
                    "global batch 16 kept")
    assert (shrunk.world_size, shrunk.train, shrunk.micro_batch, shrunk.cluster.label) == (2, plan.train, 2, "1x2xcpu")
    single, line = replan_for_world(plan, 1, Choices(pp=2), lambda p: check_runnable(p, 1, "cpu", 0))
    assert single.describe().startswith("dp1 tp1 pp1 mb2x8")
    assert line.endswith("; dropped --pp 2 (does not fit 1 process)")


def test_recovery_report_splits_the_lost_time(tmp_path):
    """A run whose rank 1 was killed during step 5 and resumed from step 2; times chosen by hand."""
    def event(kind, time, restart, **fields):
        with open(tmp_path / "events.jsonl", "a") as handle:
            handle.write(json.dumps({"kind": kind, "time": time, "restart": restart, **fields}) + "\n")

    event("launch", 100.0, LAUNCHER)
    event("start", 102.0, 0, started=101.5)
    event("ready", 102.5, 0, step=0)
    event("error", 106.2, 0, rank=0, error="error", message="RuntimeError: Connection closed by peer [::1]:5")
    event("detected", 106.5, LAUNCHER, dead_ranks=[0, 1])
    event("start", 110.0, 1, started=109.0)
    event("resumed", 111.0, 1, step=2)
    event("end", 118.0, LAUNCHER, outcome="finished")
    records = [{"step": s, "step_time_s": 0.5, "wall_time": 102.0 + s, "loss": 1.0} for s in (1, 2, 3, 4)]
    records += [{"step": s, "step_time_s": 1.0, "wall_time": 111.0 + s, "loss": 1.0} for s in (3, 4, 5, 6)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = build_report(tmp_path, metrics)
    (failure,) = report["failures"]
    # rank 0 wrote an error (its peer's sockets closed), rank 1 died silently: rank 1 was killed
    assert (failure["kind"], failure["rank"], failure["step"], failure["resumed_at_step"]) == ("killed", 1, 5, 2)
    assert failure["seconds"]["detection"] == pytest.approx(0.3)  # first error 106.2 -> agent 106.5
    assert failure["seconds"]["restart"] == pytest.approx(3.5)  # agent 106.5 -> new rank 0 at 110.0
    assert failure["seconds"]["reload"] == pytest.approx(2.0)  # new process 109.0 -> resumed 111.0
    # steps 3 and 4 are done again (0.5 s each), plus step 5's 0.2 s from step 4's end (106.0) to the failure
    assert failure["recomputed_step_count"] == 2 and failure["seconds"]["recomputed_steps"] == pytest.approx(1.2)
    assert report["productive_step_seconds"] == pytest.approx(0.5 * 2 + 1.0 * 4)  # steps 1-2 first run, 3-6 second
    assert report["effective_training_time_ratio"] == pytest.approx(5.0 / 18.0)
    assert render_report(report)[0] == ("recovery: 1 failure(s), 0 rollback(s), 0 skipped update(s), 0 straggler(s); "
                                        "effective training time 28% (5.00 s of steps in 18.00 s)")


def test_event_log_appends_lines(tmp_path):
    log = EventLog(tmp_path, restart=2)
    log.write("start", step=0)
    log.write("resumed", step=4)
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["restart"]) for e in lines] == [("start", 2), ("resumed", 2)]


@pytest.mark.parametrize("argv, message", [
    (["--max-loss-spike", "0.5"], "error: --max-loss-spike=0.5: must be above 1 (a factor over the running median "
                                  "loss), or 0 to disable spike detection"),
    (["--max-bad-steps", "-1"], "error: --max-bad-steps=-1: must be 0 (never roll back) or a positive count"),
    (["--collective-timeout", "0"], "error: --collective-timeout=0.0: must be a positive number of seconds"),
    (["--straggler-factor", "1"], "error: --straggler-factor=1.0: must be above 1, or 0 to disable"),
])
def test_bad_elastic_flags_stop_with_one_line(capsys, argv, message):
    code = main(["train", "--cluster", "1x1xcpu", "--seq-len", "32", "--device", "cpu", *argv])
    assert code == 2 and capsys.readouterr().err.strip() == message


def test_replan_keeps_sequence_parallel_off(monkeypatch):
    """`--tp 2 --no-sequence-parallel`, resumed on 2 processes: the new plan keeps sequence parallel off,
    whether the flag is given again or only the plan (file) says so."""
    import fivefold.elastic.replan as replan
    from fivefold.cli import build_parser
    from fivefold.flags import REPLAN_KEEPS

    plan = Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x4xcpu"),
                train=TrainSpec(seq_len=32, global_batch=16, dtype="fp32"), dp=2, tp=2, sequence_parallel=False)
    args = build_parser().parse_args(["train", "--tp", "2", "--no-sequence-parallel"])
    shrunk, _ = replan_for_world(plan, 2, Choices(**{k: getattr(args, k) for k in REPLAN_KEEPS}),
                                 lambda p: check_runnable(p, 2, "cpu", 0))
    assert (shrunk.tp, shrunk.sequence_parallel) == (2, False)
    searched = []  # with --plan no flag is given: the choices the planner gets come from the plan

    def spy(model, cluster, train, choices, **kw):
        searched.append(choices)
        return real_search(model, cluster, train, choices, **kw)

    real_search = replan.search
    monkeypatch.setattr(replan, "search", spy)
    replan_for_world(plan, 2, None, lambda p: check_runnable(p, 2, "cpu", 0))
    replan_for_world(plan.replace(sequence_parallel=True), 2, None, lambda p: check_runnable(p, 2, "cpu", 0))
    assert [choices.sequence_parallel for choices in searched] == [False, None]
