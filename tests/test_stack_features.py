"""Stacks are feature sets: the planner proposes only what a stack can run (cost/stack.py Features)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fivefold.cost import STACKS, estimate
from fivefold.errors import SpecError
from fivefold.planner import Choices, search
from fivefold.planner.space import zero_options
from fivefold.spec import ModelSpec, Plan, TrainSpec, parse_cluster

MODEL = ModelSpec(name="m", layers=16, hidden=1024, heads=16, kv_heads=8, ffn_hidden=2816, vocab=32000,
                  max_seq_len=8192)


def _plans(stack: str, seq_len: int = 8192, top: int = 40) -> list[Plan]:
    result = search(MODEL, parse_cluster("2x8xH100-SXM"), TrainSpec(seq_len=seq_len, global_batch=64),
                    top=top, stack=STACKS[stack])
    return [c.plan for c in result.candidates]


def test_megatron_lm_2022_never_proposes_cp_zero_bubble_or_zero3() -> None:
    plans = _plans("megatron-lm-2022")
    assert len(plans) == 40
    assert all(p.cp == 1 and p.zero in (0, 1) for p in plans)
    assert all(p.schedule in ("1f1b", "interleaved-1f1b") for p in plans if p.pp > 1)
    # The open-ended stack does use what megatron-lm-2022 lacks somewhere in its top list.
    modern = _plans("modern")
    assert any(p.zero >= 2 or p.cp > 1 or p.schedule in ("zb-h1", "zbv") for p in modern)


def test_torchtitan_uses_fsdp_levels_only() -> None:
    plans = _plans("torchtitan")
    assert all(p.zero in (0, 2, 3) for p in plans)
    assert zero_options(4, 1, Choices(), stack=STACKS["torchtitan"]) == [0, 2, 3]
    assert zero_options(4, 1, Choices(), stack=STACKS["megatron-core"]) == [1, 3]  # + Megatron-FSDP (issue 25)


def test_fixed_choice_outside_the_stack_is_one_error() -> None:
    cluster, train = parse_cluster("1x8xH100-SXM"), TrainSpec(seq_len=4096, global_batch=8)
    for choices, field in ((Choices(cp=2), "--cp"), (Choices(schedule="zbv"), "--schedule"),
                           (Choices(zero=3), "--zero")):
        with pytest.raises(SpecError) as caught:
            search(MODEL, cluster, train, choices, stack=STACKS["megatron-lm-2022"])
        assert caught.value.field == field
    with pytest.raises(SpecError, match="FP8"):
        search(MODEL, cluster, TrainSpec(seq_len=4096, global_batch=8, dtype="fp8"), stack=STACKS["megatron-lm-2022"])
    # fivefold's runtime trains FP8 with torchao's two recipes (runtime/float8.py); TE's are refused as `train` does
    from fivefold.cost.fp8 import with_fp8_recipe

    assert search(MODEL, cluster, TrainSpec(seq_len=4096, global_batch=8, dtype="fp8"), top=1,
                  stack=with_fp8_recipe(STACKS["fivefold"], "rowwise")).candidates
    with pytest.raises(SpecError, match="the fivefold stack trains FP8 with tensorwise or rowwise scaling"):
        with_fp8_recipe(STACKS["fivefold"], "delayed")


def test_estimate_names_what_the_stack_cannot_run() -> None:
    plan = Plan(model=MODEL, cluster=parse_cluster("1x8xH100-SXM"), train=TrainSpec(seq_len=4096, global_batch=8),
                dp=4, cp=2, zero=3)
    assert estimate(plan, STACKS["megatron-lm-2022"]).notes[0] == \
        "the megatron-lm-2022 stack cannot run this plan: cp > 1, ZeRO-3"
    assert not any("cannot run" in n for n in estimate(plan, STACKS["torchtitan"]).notes)


def test_estimate_help_lists_every_stack_and_its_features() -> None:
    text = subprocess.run([sys.executable, "-m", "fivefold", "estimate", "--help"], capture_output=True, text=True,
                          check=True, env={"COLUMNS": "400", "PATH": "", **_env()}).stdout
    flat = "".join(text.split())  # argparse wraps lines
    for name, stack in STACKS.items():
        if not name.endswith("-cpu"):
            assert "".join(f"{name}: {stack.features.describe()}".split()) in flat


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "HOME", "OMP_NUM_THREADS")}
