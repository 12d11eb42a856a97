"""The simulator draws DiLoCo's outer syncs (sim/diloco.py): one cycle, hand-checked against the cost model."""

from __future__ import annotations

import json

import pytest

from fivefold.cli import main
from fivefold.cost import estimate
from fivefold.sim.diloco import cycle_starts, simulate_diloco_plan
from fivefold.sim.step_input import INNER_STEPS, OUTER_SYNC
from fivefold.sim.trace import chrome_trace
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster
from fivefold.spec.diloco import DiLoCoSpec

SLOW = "1x8xH100-SXM+1x8xH100-SXM:nic=1Gb/s"


def test_cycle_waits_only_for_exchanges_that_have_not_landed():
    # Streaming: fragments sent after steps 5, 10, 15, 20, each applied 2 steps later; a 50 ms exchange under
    # 2 x 10 ms of compute leaves 30 ms to wait before steps 8, 13, 18 and 23.
    starts, drawn, exchanges = cycle_starts(DiLoCoSpec(2, 20, fragments=4, overlap=2), 0.010, 0.050)
    assert [(send, apply) for send, apply, _, _ in exchanges.values()] == [(5, 7), (10, 12), (15, 17), (20, 22)]
    assert exchanges[0][2:] == pytest.approx((0.050, 0.100))
    assert starts[7] == pytest.approx(0.100) and starts[6] == pytest.approx(0.060)  # step 8 waits for fragment 0
    assert drawn == pytest.approx(22 * 0.010 + 4 * 0.030)
    # Plain DiLoCo: one exchange after step H, the next step waits for all of it.
    starts, drawn, exchanges = cycle_starts(DiLoCoSpec(2, 5), 0.010, 0.050)
    assert exchanges == {0: pytest.approx((5, 5, 0.050, 0.100))} and drawn == pytest.approx(0.100)
    # Hidden: 2 steps of overlap cover a 15 ms exchange.
    _, drawn, _ = cycle_starts(DiLoCoSpec(2, 8, fragments=2, overlap=2), 0.010, 0.015)
    assert drawn == pytest.approx(10 * 0.010)


@pytest.mark.parametrize("fragments, overlap", [(1, 0), (4, 2)])
def test_simulated_step_agrees_with_the_estimate(fragments, overlap):
    plan = Plan(model=PRESETS["small"], cluster=parse_cluster(SLOW),
                train=TrainSpec(seq_len=1024, global_batch=64, dtype="bf16"), dp=8, tp=2)
    spec = DiLoCoSpec(2, 20, fragments=fragments, overlap=overlap)
    result, cost = simulate_diloco_plan(plan, spec, estimate(plan))
    outer = result.outer
    inner, fragment = outer["inner_step_s"], cost.fragment_exchange_s
    # The mean step is the inner step + P * max(0, fragment time - T * inner step) / H: the estimate's formula
    # on the simulated inner step, which for this plan is the estimate's own.
    hand = inner + fragments * max(0.0, fragment - overlap * inner) / 20
    assert outer["step_time_s"] == pytest.approx(hand, rel=1e-9)
    assert outer["step_time_s"] == pytest.approx(cost.step_time_s, rel=0.02)
    assert outer["exposed_per_step_s"] == pytest.approx(cost.exposed_per_step_s, rel=0.02)
    assert result.step_time_s == pytest.approx(20 * outer["step_time_s"] + overlap * inner, rel=1e-9)
    # Every rank of both groups shows every fragment's exchange, from the end of its send step, on the link.
    assert [r.label for r in result.ranks] == ["group 0 pp0: ranks 0-7", "group 1 pp0: ranks 8-15"]
    for row in range(2):
        mine = [e for e in result.events if e.rank == row and e.kind == OUTER_SYNC]
        assert [e.stage for e in mine] == list(range(fragments))
        assert all(e.end - e.start == pytest.approx(fragment) for e in mine)
        assert [e.start for e in mine] == pytest.approx([x["start_s"] for x in outer["exchanges"]])
    assert [x["send_after_step"] for x in outer["exchanges"]] == ([20] if fragments == 1 else [5, 10, 15, 20])
    assert any(e.kind == INNER_STEPS for e in result.events)  # the steps without an exchange, one bar each
    assert outer["fragment_bytes_per_rank"] == pytest.approx(cost.outer_bytes_per_rank / fragments)
    trace = [e for e in chrome_trace(result)["traceEvents"] if e.get("args", {}).get("kind") == OUTER_SYNC]
    assert len(trace) == 2 * fragments and {e["tid"] for e in trace} == {6}
    assert trace[0]["args"]["bytes"] == round(cost.outer_bytes_per_rank / fragments)
    # The outer weights and momentum are in the memory curve: 8 bytes per parameter of the rank's shard.
    assert result.ranks[0].peak_memory_bytes > cost.memory_bytes > 0


def test_simulate_cli(tmp_path, capsys):
    args = ["simulate", "--model", "small", "--cluster", SLOW, "--seq-len", "1024", "--global-batch", "64",
            "--dp", "16", "--dp-sync", "diloco", "--sync-every", "10", "--out-dir", str(tmp_path), "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["diloco"]["sync_every"] == 10 and out["diloco"]["steps_drawn"] == 10
    assert out["diloco"]["step_time_s"] == pytest.approx(out["estimate_step_time_s"], rel=0.02)
    assert main(args + ["--stage-time", "0=2"]) == 2
    assert "error: --stage-time='0=2': is not simulated with --dp-sync diloco" in capsys.readouterr().err
