"""--lr-schedule cosine|wsd|linear|constant, --min-lr, --decay-steps, --weight-decay, --betas, --eps: each curve
against its hand formula, the AdamW groups, one-line refusals before launch, and the checkpoint's record checked
on resume (one line naming the field, the checkpoint folder untouched)."""

from __future__ import annotations

import math

import pytest
import torch

from fivefold.checkpoint import save_checkpoint, step_dir
from fivefold.cli import main
from fivefold.models import build_model, init_weights
from fivefold.runtime import RunConfig
from fivefold.runtime.optim import build_optimizer
from fivefold.runtime.schedule import lr_at
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

RUN = ["train", "--cluster", "1x1xcpu", "--seq-len", "32", "--device", "cpu"]
PEAK = 1e-3


def curve(schedule: str, steps: int = 12, warmup: int = 2, **kwargs) -> list[float]:
    return [lr_at(s, PEAK, warmup, steps, schedule, **kwargs) for s in range(steps)]


def test_cosine_curve_matches_the_formula():
    lrs = curve("cosine", min_lr=2e-4)
    assert lrs[:2] == pytest.approx([0.5e-3, 1e-3])  # warmup: (s + 1) / warmup
    for s in range(2, 12):
        progress = (s - 2) / 9  # reaches 1 at the last step
        assert lrs[s] == pytest.approx(2e-4 + 0.5 * 8e-4 * (1 + math.cos(math.pi * progress)))
    assert lrs[-1] == pytest.approx(2e-4)


def test_linear_curve_matches_the_formula():
    lrs = curve("linear")  # min_lr defaults to 10% of the peak
    for s in range(2, 12):
        assert lrs[s] == pytest.approx(1e-3 - 0.9e-3 * (s - 2) / 9)
    assert lrs[2] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)


def test_constant_curve_holds_the_peak_after_warmup():
    assert curve("constant", warmup=3) == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3] + [1e-3] * 9)


def test_wsd_curve_is_stable_then_decays_linearly_over_decay_steps():
    lrs = curve("wsd", decay_steps=4, min_lr=0.0)
    assert lrs[:8] == pytest.approx([0.5e-3] + [1e-3] * 7)  # warmup 2, stable until step 12 - 4 = 8
    assert lrs[8:] == pytest.approx([1e-3 * (1 - k / 4) for k in (1, 2, 3, 4)], abs=1e-15)
    # Default decay: 20% of the 10 steps after warmup = 2 steps, to 10% of the peak.
    default = curve("wsd")
    assert default[:10] == pytest.approx([0.5e-3] + [1e-3] * 9)
    assert default[10:] == pytest.approx([1e-3 - 0.9e-3 / 2, 1e-4])


def test_config_lr_of_step_follows_the_flags():
    config = RunConfig(plan_toml="", steps=12, lr=PEAK, warmup_steps=2, lr_schedule="wsd", decay_steps=4)
    assert [config.lr_of_step(s) for s in range(12)] == curve("wsd", decay_steps=4)


def test_optimizer_takes_weight_decay_betas_and_eps():
    params = [torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))]
    optimizer = build_optimizer(params, 1e-3, weight_decay=0.05, betas=(0.8, 0.99), eps=1e-6)
    decay, no_decay = optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    assert decay["betas"] == (0.8, 0.99) and decay["eps"] == 1e-6




@pytest.mark.parametrize("argv, message", [
    (["--lr-schedule", "step"], "--lr-schedule='step': use one of cosine, wsd, linear, constant"),
    (["--min-lr", "0.01"], "--min-lr=0.01: must be a finite number from 0 to --lr (0.003)"),
    (["--min-lr", "-1"], "--min-lr=-1.0: must be a finite number from 0 to --lr (0.003)"),
    (["--lr-schedule", "constant", "--min-lr", "1e-4"],
     "--min-lr=0.0001: the constant schedule never decays; use --lr-schedule cosine, linear or wsd"),
    (["--decay-steps", "3"], "--decay-steps=3: only --lr-schedule wsd has a decay phase of its own; add "
                             "--lr-schedule wsd"),
    (["--lr-schedule", "wsd", "--decay-steps", "9"],
     "--decay-steps=9: must be from 1 to --steps minus --warmup-steps (8)"),
    (["--weight-decay", "-0.1"], "--weight-decay=-0.1: must be a finite number, 0 or more, e.g. 0.1"),
    (["--betas", "0.9"], "--betas='0.9': must be two numbers in [0, 1) separated by a comma, e.g. 0.9,0.95"),
    (["--betas", "0.9,1.0"], "--betas='0.9,1.0': must be two numbers in [0, 1) separated by a comma, e.g. "
                             "0.9,0.95"),
    (["--eps", "0"], "--eps=0.0: must be a positive finite number, e.g. 1e-8"),
])
def test_bad_optimizer_flags_are_one_line_before_launch(capsys, launched, argv, message):
    assert main([*RUN, "--steps", "10", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}" and not launched


def test_flags_reach_the_worker_and_its_torchrun_line(capsys, launched):
    assert main([*RUN, "--steps", "10", "--lr-schedule", "wsd", "--decay-steps", "3", "--betas", "0.9,0.99",
                 "--weight-decay", "0.02", "--eps", "1e-6", "--json"]) == 0
    config = launched[0][0]
    assert (config.lr_schedule, config.decay_steps, config.betas, config.weight_decay, config.eps) == \
        ("wsd", 3, "0.9,0.99", 0.02, 1e-6)
    line = capsys.readouterr().err
    assert "--lr-schedule wsd --decay-steps 3 --weight-decay 0.02 --betas 0.9,0.99 --eps 1e-06" in line


def checkpoint_with(root, optimizer: dict) -> None:
    spec = PRESETS["tiny"]
    model = build_model(spec)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    plan = Plan(model=spec, cluster=parse_cluster("1x1xcpu"), train=TrainSpec(seq_len=32, dtype="fp32"))
    state = {"step": 3, "lr_schedule": {"lr": 3e-3, "warmup_steps": 2, "steps": 10}, "optimizer": optimizer,
             "loader": {"version": 1, "seed": 0, "seq_len": 32, "windows": 38612, "dataset": "builtin",
                        "samples_seen": 24, "steps": 3}}
    save_checkpoint({"model": model.state_dict()}, spec, step_dir(root, 3), step=3, plan=plan,
                    extra={"train_state": state})


@pytest.mark.parametrize("argv, message", [
    (["--lr-schedule", "linear"], "--lr-schedule='linear': the checkpoint was trained with lr_schedule=wsd; "
                                  "resume with the same --lr-schedule"),
    (["--lr-schedule", "wsd", "--weight-decay", "0.1", "--betas", "0.9,0.95"],
     "--weight-decay=0.1: the checkpoint was trained with weight_decay=0.05; resume with the same --weight-decay"),
    (["--lr-schedule", "wsd", "--weight-decay", "0.05"],
     "--betas='0.9,0.95': the checkpoint was trained with betas=0.9,0.99; resume with the same --betas"),
])
def test_resume_with_other_optimizer_settings_names_the_field(tmp_path, capsys, launched, argv, message):
    root = tmp_path / "ck"
    record = RunConfig(plan_toml="", lr_schedule="wsd", weight_decay=0.05, betas="0.9,0.99").optimizer_record()
    checkpoint_with(root, record)
    code = main([*RUN, "--steps", "12", "--checkpoint-dir", str(root), "--resume", *argv])
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert code == 2 and not launched
    # The same settings resume (the launch is faked).
    assert main([*RUN, "--steps", "12", "--checkpoint-dir", str(root), "--resume", "--lr-schedule", "wsd",
                 "--weight-decay", "0.05", "--betas", "0.9,0.99", "--json"]) == 0
    assert launched[0][0].resume_from.endswith("step-00000003")


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_the_decay_ends_at_min_lr_on_the_last_step_for_small_step_counts(schedule):
    for steps in range(1, 8):
        for warmup in range(0, steps):  # at least one step after the warmup
            lrs = curve(schedule, steps=steps, warmup=warmup, min_lr=1e-5)
            assert lrs[-1] == pytest.approx(1e-5), (steps, warmup, lrs)  # --steps 3: step 3 is no longer the peak
            assert lrs[:warmup] == pytest.approx([PEAK * (s + 1) / warmup for s in range(warmup)])
            if steps - warmup >= 2:  # the first step after the warmup is the peak, then it falls
                assert lrs[warmup] == pytest.approx(PEAK)
                assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))
    assert curve("cosine", steps=3, warmup=2) == pytest.approx([0.5e-3, 1e-3, 1e-4])  # the issue's --steps 3
    assert curve("cosine", steps=2, warmup=2) == pytest.approx([0.5e-3, 1e-3])  # all warmup: no decay to end
