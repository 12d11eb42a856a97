"""What users see: the Chrome trace, the timeline PNG, and the Plan adapter (labels, what-if scaling)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from fivefold.errors import SpecError
from fivefold.sim import (StageTimes, StepInput, chrome_trace, from_estimate, parse_stage_times, simulate,
                          write_chrome_trace, write_timeline_png)
from fivefold.sim.from_plan import rank_labels
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster


@dataclass(frozen=True)
class FakeStageCost:  # the shape of fivefold.cost's StageCost
    forward: float
    backward_input: float
    backward_weight: float
    send_activation: float
    activation_bytes: float
    static_bytes: float


@dataclass(frozen=True)
class FakeEstimate:
    stage_costs: list
    dp_comm_s: float = 0.0
    optimizer_s: float = 0.0
    stack: str = "modern"  # the stack whose ZeRO mechanics these checks describe


def small_result():
    stage = StageTimes(1e-3, 1e-3, 1e-3, send_activation=1e-4, activation_bytes=2**29, static_bytes=2**31,
                       grad_reduce=2e-3, buckets=2)
    return simulate(StepInput("zb-h1", 2, 1, 4, (stage,) * 2, optimizer=(5e-4, 5e-4), title="test plan"))


def test_chrome_trace_has_one_process_per_rank_and_complete_events_in_microseconds(tmp_path) -> None:
    result = small_result()
    path = write_chrome_trace(result, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "pp0", 1: "pp1"}
    bars = [e for e in events if e["ph"] == "X"]
    assert len(bars) == len(result.events)
    compute = [e for e in bars if e["tid"] == 0 and e["args"]["kind"] in "FIW"]
    assert len(compute) == 2 * 4 * 3  # 2 ranks x 4 micro-batches x (F, I, W)
    first = min(compute, key=lambda e: e["ts"])
    assert first["name"] == "F s0 mb0" and first["ts"] == 0 and first["dur"] == pytest.approx(1000.0)
    end = max(e["ts"] + e["dur"] for e in bars)
    assert end == pytest.approx(result.step_time_s * 1e6)
    sends = [e for e in bars if e["args"]["kind"] == "send-activation"]
    assert {e["tid"] for e in sends} == {1} and all(e["dur"] == pytest.approx(100.0) for e in sends)
    for tid in range(4):  # bars on one thread never overlap (Perfetto needs them nested or apart)
        for pid in (0, 1):
            lane = sorted((e["ts"], e["ts"] + e["dur"]) for e in bars if e["tid"] == tid and e["pid"] == pid)
            assert all(a[1] <= b[0] + 1e-6 for a, b in zip(lane, lane[1:]))
    memory = [e for e in events if e["ph"] == "C" and e["pid"] == 0]
    assert max(e["args"]["GiB"] for e in memory) == pytest.approx(result.ranks[0].peak_memory_bytes / 2**30)
    assert trace == chrome_trace(result)


def test_timeline_png_is_written(tmp_path) -> None:
    path = write_timeline_png(small_result(), tmp_path / "timeline.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_big_step_is_drawn_as_aggregated_spans_and_traced_in_full(tmp_path) -> None:
    """pp=2, 1,200 micro-batches: 3,600 bars per rank, past AGGREGATE_ABOVE. Each rank becomes a few busy and
    communication spans covering its busy time; the trace still has one event per action."""
    from fivefold.sim.timeline import AGGREGATE_ABOVE, COMM, PIXELS_ACROSS, aggregated_bars

    stage = StageTimes(1e-3, 1e-3, 0.0, send_activation=2e-4)
    result = simulate(StepInput("1f1b", 2, 1, 1200, (stage, stage), optimizer=(1e-2, 1e-2)))
    assert sum(e.rank == 0 for e in result.events) > AGGREGATE_ABOVE
    bars = aggregated_bars(result)
    pixel = result.step_time_s / PIXELS_ACROSS
    for rank in result.ranks:
        row = 1 - rank.rank  # rank 0 on top
        busy = sorted((x, x + w) for (y, _, _, group), spans in bars.items() if group == "busy" and int(y) == row
                      for x, w in spans)
        comm = [w for (y, _, _, group), spans in bars.items() if group == COMM and int(y) == row for _, w in spans]
        assert 1 <= len(busy) <= 10 and 1 <= len(comm) <= PIXELS_ACROSS
        # Every action lies inside a busy span; what is left white between spans is at least a pixel wide.
        for event in result.events:
            if event.rank == rank.rank and event.lane == "compute":
                assert any(a - 1e-12 <= event.start and event.end <= b + 1e-12 for a, b in busy)
        assert all(b[0] - a[1] >= pixel for a, b in zip(busy, busy[1:]))
        assert rank.busy_s <= sum(b - a for a, b in busy) <= result.step_time_s
    path = write_timeline_png(result, tmp_path / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(write_chrome_trace(result, tmp_path / "trace.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(result.events) == 2 * (2 * 1200 + 1200 + 1)


def plan_of(cluster: str, **layout) -> Plan:
    return Plan(model=PRESETS["tiny"], cluster=parse_cluster(cluster), train=TrainSpec(global_batch=8, dtype="fp32"),
                **layout)


def test_from_estimate_maps_stages_scales_and_labels() -> None:
    plan = plan_of("1x4xcpu", dp=2, pp=2)
    costs = [FakeStageCost(1.0, 1.5, 0.5, 0.1, 10.0, 100.0), FakeStageCost(2.0, 2.5, 1.5, 0.1, 10.0, 300.0)]
    step = from_estimate(plan, FakeEstimate(costs, dp_comm_s=0.6, optimizer_s=0.2), {1: 2.0})
    assert (step.schedule, step.pp, step.micro_batches) == ("1f1b", 2, 4)
    assert step.stages[0].forward == 1.0 and step.stages[1].forward == 4.0 and step.stages[1].backward_weight == 3.0
    assert step.stages[1].send_activation == 0.1  # what-if scales compute, not communication
    # Gradients are all-reduced over the dp pair once, after the last backward; no gathers at ZeRO-0.
    assert step.stages[0].grad_reduce > 0 and step.stages[0].param_gather == 0
    assert not step.stages[0].reduce_every_micro_batch and not step.stages[0].reshard_after_forward
    # ZeRO-3 over 2 ranks: a reduce-scatter is half a ring all-reduce; fp32 weights gather like fp32 grads.
    sharded = from_estimate(plan.replace(zero=3), FakeEstimate(costs))
    assert sharded.stages[0].grad_reduce == pytest.approx(step.stages[0].grad_reduce / 2)
    assert sharded.stages[0].param_gather == pytest.approx(sharded.stages[0].grad_reduce)
    assert sharded.stages[0].reduce_every_micro_batch and sharded.stages[0].reshard_after_forward
    assert sharded.stages[0].reshard_after_backward
    assert step.optimizer == (0.2, 0.2)
    assert step.rank_labels == ("pp0: ranks 0-1", "pp1: ranks 2-3")
    assert "stage 1 x2" in step.title


def test_mixed_cluster_rows_name_their_devices() -> None:
    plan = plan_of("1x2xA100-80GB+1x2xH100-SXM", dp=2, pp=2)
    assert rank_labels(plan) == ("pp0: ranks 0-1\nA100-80GB", "pp1: ranks 2-3\nH100-SXM")


def test_stage_time_flags() -> None:
    assert parse_stage_times(["0=1.5", "3=0.5", "0=2"], 4) == {0: 2.0, 3: 0.5}
    for bad in ("4=1.5", "x=2", "1", "1=0", "1=-2"):
        with pytest.raises(SpecError, match="--stage-time"):
            parse_stage_times([bad], 4)


def test_simulator_never_imports_torch() -> None:
    """The planner calls the simulator on machines without PyTorch: sim/ (and what it uses) stays torch-free."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from fivefold.sim import simulate_plan\n"
            "from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster\n"
            "plan = Plan(model=PRESETS['tiny'], cluster=parse_cluster('1x4xcpu'), train=TrainSpec(), dp=2, pp=2)\n"
            "simulate_plan(plan)\n"
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules, sorted(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_outputs_of_a_big_step_are_written_side_by_side(tmp_path, monkeypatch) -> None:
    """Past FORK_ABOVE events a child process writes the trace while this one draws: the same files."""
    from fivefold.sim import outputs

    monkeypatch.setattr(outputs, "FORK_ABOVE", 0)
    result = small_result()
    trace_path, png_path = outputs.write_outputs(result, tmp_path / "out")
    assert json.loads(trace_path.read_text()) == chrome_trace(result)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
