"""`fivefold train --compile`: torch.compile per transformer block (inductor on CPU) computes the same
training run as eager, within 1e-5 in fp32. Kept tiny: inductor compiles on 2 shared cores."""

from __future__ import annotations

import json
import shutil

import pytest

from fivefold.runtime import RunConfig, launch
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

STEPS = 3


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="inductor needs a C compiler")
def test_compiled_blocks_match_eager(tmp_path):
    plan = Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x1xcpu"),
                train=TrainSpec(seq_len=32, global_batch=4, dtype="fp32"), micro_batch=4)
    configs = [RunConfig(plan.to_toml(), steps=STEPS, device="cpu", show_progress=False, compile=compiled,
                         metrics_file=str(tmp_path / f"{name}.jsonl"))
               for name, compiled in (("eager", False), ("compiled", True))]
    launch(configs, 1)
    eager, compiled = ([json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
                       for name in ("eager", "compiled"))
    assert len(compiled) == STEPS
    for ref, rec in zip(eager, compiled):
        assert rec["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert compiled[-1]["loss"] < compiled[0]["loss"]
