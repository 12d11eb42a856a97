"""--eval-data / --eval-every / --eval-batches: eval_loss and eval_perplexity in the metrics record of the
steps that evaluate, in the terminal and TensorBoard, and the same numbers under every layout (fp32, CPU,
within 1e-5 of the single process; plans of one world size share one launch as in test_parity_plans.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fivefold.cli import main
from fivefold.data import builtin_corpus, write_tokens
from fivefold.runtime import RunConfig, launch
from fivefold.runtime.metrics import format_step
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

STEPS = 3
PLANS = {"dp2": dict(dp=2, micro_batch=2), "dp2-fsdp": dict(dp=2, zero=3, micro_batch=2),
         "tp2": dict(tp=2, sequence_parallel=True, micro_batch=4), "pp2-1f1b": dict(pp=2, schedule="1f1b",
                                                                                    micro_batch=2),
         "cp2": dict(cp=2, micro_batch=4),
         "pp2-zbv": dict(pp=2, schedule="zbv", virtual_stages=2, micro_batch=2),  # two stages on a rank
         "pp2-vocab-zbv": dict(pp=2, schedule="zbv", virtual_stages=2, micro_batch=2, vocab_parallel=True)}


def eval_file(folder: Path) -> Path:
    """Held-out stories: the built-in corpus's grammar drawn with another seed, as bytes."""
    text = builtin_corpus(stories=40, seed=1)
    return write_tokens(np.frombuffer(text.encode(), dtype=np.uint8), folder / "valid.bin")


def run(plans: dict[str, dict], world: int, folder: Path, valid: Path) -> dict[str, list[dict]]:
    configs = []
    for name, fields in plans.items():
        plan = Plan(model=PRESETS["tiny"], cluster=parse_cluster(f"1x{world}xcpu"),
                    train=TrainSpec(seq_len=32, global_batch=8, dtype="fp32"), **fields)
        configs.append(RunConfig(plan.to_toml(), steps=STEPS, device="cpu", show_progress=False,
                                 metrics_file=str(folder / f"{name}.jsonl"), eval_data=str(valid), eval_every=2,
                                 eval_batches=2))
    launch(configs, world)
    return {name: [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
            for name in plans}


@pytest.mark.slow
def test_eval_loss_is_the_same_under_every_layout(tmp_path):
    valid = eval_file(tmp_path)
    reference = run({"single": {}}, 1, tmp_path, valid)["single"]
    assert ["eval_loss" in r for r in reference] == [False, True, True]  # every 2 steps and after the last
    first, last = reference[1], reference[2]
    assert 4.0 < last["eval_loss"] < first["eval_loss"] < 5.6  # from near ln(256) = 5.55, falling
    assert last["eval_perplexity"] == pytest.approx(math.exp(last["eval_loss"]), rel=1e-12)
    for name, records in run(PLANS, 2, tmp_path, valid).items():
        for ref, rec in zip(reference, records):
            assert rec["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
            assert ("eval_loss" in rec) == ("eval_loss" in ref), name
            if "eval_loss" in ref:
                assert rec["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5), (name, rec["step"])


def test_the_terminal_line_and_tensorboard_tags_carry_the_evaluation(tmp_path):
    from fivefold.runtime.tensorboard import STEP_SCALARS

    record = {"step": 2, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0, "mfu": 0.01,
              "peak_memory_gib": 0.3, "step_time_s": 0.1, "eval_loss": 4.25, "eval_perplexity": math.exp(4.25)}
    assert format_step(record).endswith("eval_loss 4.2500  eval_ppl 70.11")
    assert STEP_SCALARS["eval_loss"] == "eval/loss" and STEP_SCALARS["eval_perplexity"] == "eval/perplexity"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fivefold.runtime.tensorboard import TensorBoardWriter

    writer = TensorBoardWriter(str(tmp_path / "tb"))
    writer.write(record)
    writer.write({**record, "step": 3, "eval_loss": None, "eval_perplexity": None})  # a step without evaluation
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("eval/loss")] == [(2, 4.25)]
    assert [round(e.value, 2) for e in events.Scalars("eval/perplexity")] == [70.11]




@pytest.mark.parametrize("argv, message", [
    (["--eval-every", "2"], "--eval-every=2: needs --eval-data (validation data)"),
    (["--eval-batches", "2"], "--eval-batches=2: needs --eval-data (validation data)"),
    (["--eval-data", "{d}/valid.bin", "--eval-every", "-1"],
     "--eval-every=-1: must be 0 (only after the last step) or a positive step count"),
    (["--eval-data", "{d}/valid.bin", "--eval-batches", "0"], "--eval-batches=0: must be at least 1 global batch"),
    (["--eval-data", "{d}/missing.jsonl"], "--eval-data='{d}/missing.jsonl': no such file or folder"),
])
def test_bad_eval_flags_are_one_line(tmp_path, capsys, launched, argv, message):
    eval_file(tmp_path)
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    assert main(["train", "--nproc", "1", "--seq-len", "32", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: " + message.replace("{d}", str(tmp_path))) and not launched
