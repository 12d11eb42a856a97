"""An MoE run says what happened: `fivefold report` predicts with the expert load, expert GEMMs and FP8 recipe the
run measured and says so; an MoE model that nothing balances gets one warning line at launch; an expert collapse
(one expert taking every token for COLLAPSE_STEPS steps) becomes an event of the run and a line of its report."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fivefold.cli import main
from fivefold.cost import estimate, stack_named
from fivefold.cost.stack import with_expert_gemm
from fivefold.report import report_run
from fivefold.runtime.expert_parallel import COLLAPSE_STEPS, CollapseWatch, balance_warning, moe_step_metrics
from fivefold.spec import PRESETS, ModelSpec, Plan, TrainSpec, parse_cluster

MOE = ModelSpec(name="moe-64x8", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=256, max_seq_len=512,
                experts=64, top_k=8, expert_ffn_hidden=64, aux_loss_coef=0.01)


def write_moe_run(folder, plan: Plan, loads: list[float], extra: dict | None = None, events: list[dict] = ()):
    folder.mkdir(parents=True, exist_ok=True)
    plan.save(folder / "plan.toml")
    tokens = plan.train.tokens_per_step
    lines = [json.dumps({"step": step, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": tokens * step,
                         "step_time_s": 0.5, "tokens_per_s": tokens / 0.5, "mfu": 0.1, "peak_memory_gib": 1.0,
                         "aux_loss": 0.1, "expert_load_max_over_mean": load, **(extra or {})})
             for step, load in enumerate(loads, 1)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def test_report_predicts_with_the_measured_expert_load_and_the_experts_that_ran(tmp_path):
    plan = Plan(model=MOE, cluster=parse_cluster("1x1xH200"), train=TrainSpec(seq_len=256, global_batch=8))
    folder = write_moe_run(tmp_path / "run", plan, [8.0, 8.0, 7.0, 8.0, 8.0, 8.0], {"expert_gemm": "loop"})
    report = report_run(str(folder))
    assert any(note.startswith("predicted with the expert load this run measured (the busiest expert 8x the mean")
               for note in report.notes)
    # the same as estimating the plan with that load and the experts as the run ran them (a GEMM per expert)
    skewed = plan.replace(train=dataclasses.replace(plan.train, expert_load=8.0))
    expected = estimate(skewed, with_expert_gemm(stack_named("fivefold"), "loop"))
    assert report.figures[1].predicted == pytest.approx(expected.tokens_per_s, rel=1e-9)
    assert report.figures[1].predicted != pytest.approx(estimate(plan, stack_named("fivefold")).tokens_per_s,
                                                        rel=1e-3)
    assert report.moe["expert_gemm"] == "loop"


def test_report_lists_the_runs_expert_collapses(tmp_path, capsys):
    plan = Plan(model=PRESETS["tiny-moe"], cluster=parse_cluster("1x1xcpu"), train=TrainSpec(seq_len=32, global_batch=8,
                                                                                          dtype="fp32"))
    event = {"kind": "expert_collapse", "time": 0.0, "restart": 0, "step": 4, "layer": 1, "expert": 3,
             "since_step": 2, "steps": COLLAPSE_STEPS}
    folder = write_moe_run(tmp_path / "run", plan, [1.5, 2.0, 2.0, 2.0, 2.0], events=[event])
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "expert collapse: MoE layer 1 sent every token to expert 3 for 3 steps from step 2 (the run's events)" in out
    assert main(["report", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["moe"]["collapses"] == [
        {"layer": 1, "expert": 3, "since_step": 2, "steps": COLLAPSE_STEPS}]


def test_collapse_is_one_expert_taking_every_token_for_k_steps_in_a_row():
    watch = CollapseWatch(dataclasses.replace(MOE, layers=2))
    every = [(5, True), (9, False)]  # layer 0: expert 5 took every token; layer 1 did not
    assert watch.observe(1, every) == [] and watch.observe(2, every) == []
    assert watch.observe(3, every) == [{"layer": 0, "expert": 5, "since_step": 1, "steps": COLLAPSE_STEPS}]
    assert watch.observe(4, every) == []  # reported once per streak
    assert watch.observe(5, [(5, False), (9, False)]) == []  # recovered
    assert watch.observe(6, [(7, True), (9, True)]) == watch.observe(7, [(7, True), (9, True)]) == []
    assert watch.observe(8, [(7, True), (2, True)]) == [{"layer": 0, "expert": 7, "since_step": 6, "steps": 3}]


def test_step_metrics_name_the_busiest_expert_and_whether_it_took_every_token():
    """moe_step_metrics on blocks whose loads were recorded: 16 tokens x top-2 over 4 experts."""
    from fivefold.models import MoE, build_model

    spec = dataclasses.replace(PRESETS["tiny-moe"], layers=2)
    model = build_model(spec)
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    blocks[0].load = torch.tensor([16.0, 10.0, 6.0, 0.0], dtype=torch.float64)  # expert 0 in every token's top-2
    blocks[1].load = torch.tensor([8.0, 8.0, 8.0, 8.0], dtype=torch.float64)
    plan = Plan(model=spec, cluster=parse_cluster("1x1xcpu"), train=TrainSpec(seq_len=8, global_batch=2, dtype="fp32"))
    metrics = moe_step_metrics({0: model}, plan, torch.device("cpu"), update_bias=False)
    assert metrics["expert_busiest"] == [[0, True], [0, False]]
    assert metrics["expert_load_per_layer"] == [2.0, 1.0]


def test_an_moe_model_nothing_balances_gets_one_warning_at_launch(tmp_path, capsys, launched):
    unbalanced = "layers=2,hidden=64,heads=4,vocab=256,experts=4,top_k=2,expert_ffn_hidden=64"
    assert main(["train", "--model", unbalanced, "--nproc", "1", "--steps", "1", "--json"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert err == ["warning: custom is an MoE model with neither an auxiliary loss (aux_loss_coef=0) nor a bias update "
                   "(router_bias_rate=0): nothing stops the router from sending every token to the same experts; set "
                   "aux_loss_coef (e.g. 0.01) or router_bias_rate (e.g. 0.001) in the model"]
    assert len(launched) == 1
    for balanced in (unbalanced + ",aux_loss_coef=0.01", unbalanced + ",router_bias_rate=0.001"):
        assert main(["train", "--model", balanced, "--nproc", "1", "--steps", "1", "--json"]) == 0
        assert "warning:" not in capsys.readouterr().err
    assert balance_warning(PRESETS["tiny"]) is None  # dense
