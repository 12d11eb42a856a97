"""Mixed-cluster plans in the runtime: uneven layers per stage together with uneven micro-batches per
replica, and a plan the planner made for a mixed CPU cluster, match the single-process run (fp32, 1e-5)
while the slowdown knob slows one device; the knob itself changes no number and sleeps in proportion to
the work it slows."""

from __future__ import annotations

import time

import pytest
import torch

from fivefold.errors import SpecError
from fivefold.models import build_model, init_weights
from fivefold.planner import Choices, search
from fivefold.runtime.launch import check_runnable
from fivefold.runtime.slowdown import ENV, slow_down, slow_factors
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster
from test_parity_plans import MODELS, RTOL, STEPS, make_plan, run_plans

MIXED_CPU = "1x2xcpu+1x2xcpu:speed=0.5"  # devices 2 and 3 at half speed, what FIVEFOLD_SLOW_DEVICES=2:2,3:2 does


def test_slow_factors_parse_and_reject():
    assert slow_factors("") == {}
    assert slow_factors("1:3, 3:2.5") == {1: 3.0, 3: 2.5}
    for bad in ("1", "1:0.5", "x:2", "-1:2"):
        with pytest.raises(SpecError, match=ENV):
            slow_factors(bad)


def _step(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_knob_changes_no_number_and_sleeps_for_the_blocks_work(monkeypatch):
    spec = PRESETS["small"]
    plan = Plan(model=spec, cluster=parse_cluster("1x2xcpu"), train=TrainSpec(seq_len=64, global_batch=2,
                                                                                 dtype="fp32"), dp=2)
    tokens = torch.randint(0, spec.vocab, (2, 65), generator=torch.Generator().manual_seed(0))
    slept: list[float] = []  # seconds actually slept, per sleep
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        started = time.perf_counter()
        real_sleep(seconds)
        slept.append(time.perf_counter() - started)
    monkeypatch.setattr("fivefold.runtime.slowdown.time.sleep", sleep)

    def run(rank: int) -> tuple[float, list[torch.Tensor], float]:
        model = slow_down(build_model(spec, device="meta"), plan, rank)
        model.to_empty(device="cpu")
        init_weights(model, 0)
        started = time.perf_counter()
        loss, grads = _step(model, tokens)
        return loss, grads, time.perf_counter() - started

    monkeypatch.setenv(ENV, "1:3")  # device 1 (rank 1 under the identity placement) 3x slower
    run(0)  # warm-up
    loss, grads, _ = run(0)
    assert slept == []  # rank 0 sits on device 0, which is not slowed
    slow_loss, slow_grads, seconds = run(1)
    assert slow_loss == loss and all(torch.equal(a, b) for a, b in zip(grads, slow_grads))
    # After each block's, the norm's and the head's forward and backward, unless an earlier sleep overshot.
    assert 2 * spec.layers <= len(slept) <= 2 * (spec.layers + 2)
    # 2x the blocks' and head's own time: most of the working time, but not the embedding, loss or autograd.
    working = seconds - sum(slept)
    assert 2 * 0.6 * working < sum(slept) < 2 * 1.05 * working


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("hetero")
    records = run_plans({"ref-tiny": make_plan(1, "tiny")}, 1, folder)
    mixed = parse_cluster(MIXED_CPU)
    planned = search(MODELS["tiny"], mixed, TrainSpec(seq_len=32, global_batch=8, dtype="fp32"),
                     Choices(cp=1, tp=1), top=1).candidates[0].plan
    check_runnable(planned, 4)
    plans = {"dp2xpp2-layers-1-3-replicas-3-5": make_plan(4, "tiny", dp=2, pp=2, schedule="1f1b", micro_batch=1,
                                                            layers_per_stage=(1, 3), replica_micro_batches=(3, 5)),
             "planned-for-mixed-cpu": planned}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, "2:2,3:2")  # the workers inherit it: devices 2 and 3 run at half speed
        records.update(run_plans(plans, 4, folder))
    records["plans"] = plans
    return records


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2xpp2-layers-1-3-replicas-3-5", "planned-for-mixed-cpu"])
def test_mixed_plans_match_the_single_process_run(runs, name):
    records, reference = runs[name], runs["ref-tiny"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for ref, rec in zip(reference, records):
        assert rec["loss"] == pytest.approx(ref["loss"], rel=RTOL), (name, rec["step"])
        assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL), (name, rec["step"])


@pytest.mark.slow
def test_the_planned_plan_is_uneven_towards_the_fast_devices(runs):
    plan = runs["plans"]["planned-for-mixed-cpu"]
    slots = plan.cluster.slots()
    fast = [r for r in range(plan.world_size) if slots[plan.placement[r]].group == 0]
    slow = [r for r in range(plan.world_size) if slots[plan.placement[r]].group == 1]

    def work(rank: int) -> int:
        coords = plan.coords(rank)
        layers = sum(plan.layers_per_stage[s] for s in plan.stages_of(coords["pp"]))
        return layers * plan.micro_batches_of_replica(coords["dp"])
    assert min(work(r) for r in fast) > max(work(r) for r in slow)
