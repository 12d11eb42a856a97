"""runtime/trace.py without processes: which steps are traced, spans, the pipelining instrumentation (on
a stand-in stage with the methods torch's schedules call), the files it writes, and the per-rank gather."""

from __future__ import annotations

import json
import time

import pytest
import torch

from fivefold.runtime.metrics import PER_RANK_FIELDS, gather_from_ranks, seconds_since
from fivefold.runtime.trace import (CHROME_TRACE_FILE, OPTIMIZER, STEP, TRACE_FILE, StepTracer, chrome_trace,
                                    traced_steps)
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster


def pp2_plan(schedule: str = "1f1b", virtual: int = 1) -> Plan:
    return Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x2xcpu"), train=TrainSpec(seq_len=32, global_batch=8),
                pp=2, micro_batch=2, schedule=schedule, virtual_stages=virtual)


@pytest.mark.parametrize("total, expected", [(1, [1]), (2, [1, 2]), (3, [2, 3]), (4, [3, 4]), (5, [3, 4, 5]),
                                             (10, [3, 4, 5])])
def test_traced_steps_follow_the_warm_up(total, expected):
    assert list(traced_steps(total)) == expected


def test_a_resumed_run_traces_the_steps_after_its_own_warm_up(tmp_path):
    tracer = StepTracer(pp2_plan(), 0, torch.device("cpu"), 20, tmp_path)  # resumed at step 11 of 20
    traced = []
    for step in range(11, 21):
        tracer.begin_step(step)
        traced += [step] if tracer.active else []
        tracer.end_step()
    assert traced == [13, 14, 15]
    assert sorted({e["step"] for e in tracer.events}) == [13, 14, 15]


class FakeStage:
    """The PipelineStage methods torch.distributed.pipelining's schedules call, each sleeping a little."""

    def __init__(self, index: int, last: bool) -> None:
        self.stage_index, self.is_last = index, last

    def forward_one_chunk(self, mb, args, kwargs=None, save_forward_output=True):
        time.sleep(0.002)
        return ("out", mb)

    def backward_one_chunk(self, mb, loss=None, full_backward=True, last_backward=False):
        time.sleep(0.003)

    def backward_weight_one_chunk(self, mb, last_backward=False):
        time.sleep(0.001)

    def perform_reduce_grad(self, scale):
        pass


class FakeSchedule:
    def __init__(self, stages):
        self._stages = stages

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        time.sleep(0.004)


def test_instrumented_schedule_records_each_action_and_folds_the_loss_into_the_last_forward(tmp_path):
    plan = pp2_plan("zbv", 2)
    stages = [FakeStage(0, False), FakeStage(3, True)]  # rank 0 of a V: stages 0 and 3
    schedule = FakeSchedule(stages)
    tracer = StepTracer(plan, 0, torch.device("cpu"), 3, tmp_path)  # a 3-step run traces steps 2 and 3
    tracer.instrument(schedule)
    for step in (1, 2):
        tracer.begin_step(step)
        output = stages[1].forward_one_chunk(1, ())
        schedule._maybe_compute_loss(stages[1], output, None, 1)
        stages[0].forward_one_chunk(0, ())
        stages[1].backward_one_chunk(1, loss=None, full_backward=False)
        stages[1].backward_weight_one_chunk(1)
        stages[0].backward_one_chunk(0)
        with tracer.span(OPTIMIZER):
            time.sleep(0.001)
        tracer.end_step()
    assert output == ("out", 1)  # the wrapper passes results through
    events = tracer.events
    assert {e["step"] for e in events} == {2}  # step 1 is not traced
    kinds = [(e["kind"], e["stage"], e["micro_batch"]) for e in events]
    assert kinds == [("F", 3, 1), ("F", 0, 0), ("I", 3, 1), ("W", 3, 1), ("B", 0, 0), ("optimizer", -1, -1),
                     ("step", -1, -1)]
    seconds = {k: e["end"] - e["start"] for k, e in zip(kinds, events)}
    assert seconds[("F", 3, 1)] >= 0.006  # forward 2 ms + loss 4 ms
    assert 0.002 <= seconds[("F", 0, 0)] < 0.006  # no loss on a stage that is not the last
    assert seconds[("I", 3, 1)] >= 0.003 and seconds[("W", 3, 1)] >= 0.001
    step = events[-1]
    assert all(step["start"] <= e["start"] <= e["end"] <= step["end"] for e in events)
    for before, after in zip(events[:-2], events[1:-1]):  # one after another on the rank
        assert before["end"] <= after["start"]
    assert all(e["rank"] == 0 and e["pp_rank"] == 0 for e in events)

    path = tracer.finish()  # one process, no process group: writes this rank's events
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert path.name == TRACE_FILE and len(lines) == len(events)
    chrome = json.loads((tmp_path / CHROME_TRACE_FILE).read_text())
    bars = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    # sorted by start: the step opens before its first action
    assert [b["name"] for b in bars] == ["step 2", "F s3 mb1", "F s0 mb0", "I s3 mb1", "W s3 mb1", "B s0 mb0",
                                         "optimizer"]
    assert bars[0]["ts"] == 0.0 and bars[0]["tid"] == 1
    assert bars[1]["dur"] == pytest.approx(seconds[("F", 3, 1)] * 1e6)


def test_a_tracer_without_steps_records_nothing_and_removes_a_stale_trace(tmp_path):
    (tmp_path / TRACE_FILE).write_text("{}\n")
    (tmp_path / CHROME_TRACE_FILE).write_text("{}")
    tracer = StepTracer(pp2_plan(), 0, torch.device("cpu"), None, tmp_path)
    assert not (tmp_path / TRACE_FILE).exists() and not (tmp_path / CHROME_TRACE_FILE).exists()
    tracer.begin_step(3)
    with tracer.span(OPTIMIZER):
        pass
    tracer.end_step()
    assert tracer.events == [] and tracer.finish() is None
    assert not (tmp_path / TRACE_FILE).exists()


def test_chrome_trace_names_every_rank_by_its_coordinates():
    plan = pp2_plan()
    events = [{"rank": 1, "pp_rank": 1, "step": 3, "kind": STEP, "stage": -1, "micro_batch": -1, "start": 10.0,
               "end": 10.5},
              {"rank": 1, "pp_rank": 1, "step": 3, "kind": "F", "stage": 1, "micro_batch": 0, "start": 10.1,
               "end": 10.2}]
    trace = chrome_trace(plan, events)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert names == {0: "rank 0 (pp0 dp0 cp0 tp0)", 1: "rank 1 (pp1 dp0 cp0 tp0)"}
    forward = next(e for e in trace if e.get("name") == "F s1 mb0")
    assert forward["ts"] == pytest.approx(0.1e6) and forward["dur"] == pytest.approx(0.1e6) and forward["tid"] == 0


def test_per_rank_gather_and_own_step_time_in_one_process():
    assert gather_from_ranks([0.5, 0.02], torch.device("cpu"), 0) == [[0.5, 0.02]]
    start = time.perf_counter()
    time.sleep(0.01)
    assert 0.01 <= seconds_since(start, torch.device("cpu")) < 1.0
    assert PER_RANK_FIELDS == ("peak_memory_gib_per_rank", "step_time_s_per_rank")
