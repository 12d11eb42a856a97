"""Resume and reshard: a run checkpointed at step 3 continues exactly under the same plan (every later loss
==), and under another plan and process count within 1e-5 relative of the uninterrupted run; the first
loss from Hugging Face weights is the same under every plan and equals transformers' own loss.

All runs of one world size share one launch (as in test_parity_plans.py); a launch's configs run one
after another, so later configs resume from checkpoints the earlier ones wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fivefold
from fivefold.checkpoint import checkpoint_problem, read_checkpoint_info, step_dir
from fivefold.data import GlobalBatchLoader, load_tokenizer, open_dataset
from fivefold.runtime import RunConfig, launch
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

STEPS = 6
SAVED_AT = 3
RTOL = 1e-5
SEQ_LEN, GLOBAL_BATCH = 32, 8

# Source runs: name -> (world, plan fields, config fields); each saves every 3 steps of 6.
SOURCES = {
    "dp2-zero3-recompute": (2, dict(dp=2, zero=3, micro_batch=2, recompute="full"), {}),
    "tp2-sync-save": (2, dict(tp=2, sequence_parallel=True, micro_batch=4), dict(checkpoint_async=False)),
    "pp2-1f1b": (2, dict(pp=2, schedule="1f1b", micro_batch=2), {}),
    "dp2xpp2": (4, dict(dp=2, pp=2, schedule="gpipe", micro_batch=2), {}),
    "pp2-vocab-zbv": (2, dict(pp=2, schedule="zbv", virtual_stages=2, micro_batch=2, vocab_parallel=True), {}),
}
# Resumed runs: name -> (source, world, plan fields).
RESUMES = {
    "same:dp2-zero3-recompute": ("dp2-zero3-recompute", 2, SOURCES["dp2-zero3-recompute"][1]),
    "same:pp2-1f1b": ("pp2-1f1b", 2, SOURCES["pp2-1f1b"][1]),
    "dp2-zero3 -> tp2": ("dp2-zero3-recompute", 2, dict(tp=2, sequence_parallel=True, micro_batch=4)),
    "tp2 -> dp2-zero1": ("tp2-sync-save", 2, dict(dp=2, zero=1, micro_batch=1)),
    "pp2-1f1b -> pp2-interleaved-v2": ("pp2-1f1b", 2, dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                                                          micro_batch=2)),
    "dp2xpp2 -> dp1": ("dp2xpp2", 1, {}),
    # the vocabulary slices are DTensors of the global shape: DCP reshards them to and from whole tensors
    "pp2-vocab-zbv -> pp2-1f1b": ("pp2-vocab-zbv", 2, SOURCES["pp2-1f1b"][1]),
    "pp2-1f1b -> pp2-vocab-zbv": ("pp2-1f1b", 2, SOURCES["pp2-vocab-zbv"][1]),
}
HF_PLANS = {"hf:single": (1, {}), "hf:dp2": (2, dict(dp=2, micro_batch=2)),
            "hf:tp2": (2, dict(tp=2, sequence_parallel=True, micro_batch=4)),
            "hf:pp2": (2, dict(pp=2, schedule="1f1b", micro_batch=2))}


def make_plan(world: int, model=PRESETS["tiny"], **fields) -> Plan:
    return Plan(model=model, cluster=parse_cluster(f"1x{world}xcpu"),
                train=TrainSpec(seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, dtype="fp32"), **fields)


def run_config(folder: Path, name: str, plan: Plan, steps: int = STEPS, **fields) -> RunConfig:
    return RunConfig(plan.to_toml(), steps=steps, seed=0, device="cpu", show_progress=False,
                     metrics_file=str(folder / f"{name}.jsonl"), **fields)


def records(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]


def the_batch(step: int) -> torch.Tensor:
    """The global batch of 1-based step `step` ([GLOBAL_BATCH, SEQ_LEN + 1]), as every plan draws it."""
    loader = GlobalBatchLoader(open_dataset(None, load_tokenizer(None)), SEQ_LEN, GLOBAL_BATCH, seed=0)
    for _ in range(step):
        batch = loader.next_batch()
    return batch


def hf_llama(folder: Path):
    """A random LlamaForCausalLM of the tiny preset's shape, saved with save_pretrained (no download)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to one; random ones make the comparison sharper
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.weight.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from fivefold.checkpoint.hf import read_hf_config

    folder = tmp_path_factory.mktemp("resume")
    hf_model = hf_llama(folder / "hf")
    hf_spec = read_hf_config(folder / "hf")[1]
    by_world: dict[int, list[RunConfig]] = {1: [run_config(folder, "reference", make_plan(1))], 2: [], 4: []}
    for name, (world, fields, extra) in SOURCES.items():
        by_world[world].append(run_config(folder, name, make_plan(world, **fields),
                                          checkpoint_dir=str(folder / name), checkpoint_every=SAVED_AT, **extra))
    for name, (source, world, fields) in RESUMES.items():
        by_world[world].append(run_config(folder, name, make_plan(world, **fields),
                                          resume_from=str(step_dir(folder / source, SAVED_AT))))
    for name, (world, fields) in HF_PLANS.items():
        by_world[world].append(run_config(folder, name, make_plan(world, model=hf_spec, **fields), steps=1,
                                          init_from_hf=str(folder / "hf")))
    summaries = {}
    for world in (4, 2, 1):  # sources of 4 processes first: the 1-process launch resumes from one
        for config, summary in zip(by_world[world], launch(by_world[world], world)):
            summaries[Path(config.metrics_file).stem] = summary
    return {"folder": folder, "hf_model": hf_model, "summaries": summaries}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RESUMES if n.startswith("same:")])
def test_same_plan_resume_is_bit_identical(runs, name):
    folder = runs["folder"]
    uninterrupted = records(folder, RESUMES[name][0])
    resumed = records(folder, name)
    assert [r["step"] for r in resumed] == list(range(SAVED_AT + 1, STEPS + 1))
    for before, after in zip(uninterrupted[SAVED_AT:], resumed):
        assert after["loss"] == before["loss"], (name, after["step"])
        assert after["grad_norm"] == before["grad_norm"], (name, after["step"])
        assert after["lr"] == before["lr"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RESUMES if not n.startswith("same:")])
def test_resume_under_another_plan_matches_the_uninterrupted_run(runs, name):
    folder = runs["folder"]
    uninterrupted, reference = records(folder, RESUMES[name][0]), records(folder, "reference")
    resumed = records(folder, name)
    assert [r["step"] for r in resumed] == list(range(SAVED_AT + 1, STEPS + 1))
    for before, single, after in zip(uninterrupted[SAVED_AT:], reference[SAVED_AT:], resumed):
        assert after["loss"] == pytest.approx(before["loss"], rel=RTOL), (name, after["step"])
        assert after["loss"] == pytest.approx(single["loss"], rel=RTOL), (name, after["step"])
        assert after["grad_norm"] == pytest.approx(before["grad_norm"], rel=RTOL), (name, after["step"])
        assert after["lr"] == before["lr"]
    # The training really moved on from step 3: a resume that restarted from the initial weights
    # would repeat the first losses instead.
    assert resumed[0]["loss"] < reference[0]["loss"] - 0.5


@pytest.mark.slow
def test_checkpoints_are_committed_with_clean_names_and_the_run_state(runs):
    from torch.distributed.checkpoint import FileSystemReader

    root = runs["folder"] / "dp2-zero3-recompute"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003", "step-00000006"]
    for step in (3, 6):
        assert checkpoint_problem(step_dir(root, step)) is None
    info = read_checkpoint_info(step_dir(root, SAVED_AT))
    state = info["extra"]["train_state"]
    assert state["step"] == SAVED_AT and state["loader"]["samples_seen"] == SAVED_AT * GLOBAL_BATCH
    assert state["lr_schedule"] == {"lr": 3e-3, "warmup_steps": 2, "steps": STEPS}
    assert state["optimizer"] == {"lr_schedule": "cosine", "min_lr": None, "decay_steps": None, "weight_decay": 0.1,
                                  "betas": [0.9, 0.95], "eps": 1e-8}
    assert info["plan"]["plan"]["zero"] == 3 and info["model"] == PRESETS["tiny"]
    keys = FileSystemReader(str(step_dir(root, SAVED_AT))).read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    from fivefold.models import build_model

    assert model_keys == set(build_model(PRESETS["tiny"], device="meta").state_dict())  # no wrapper names
    assert {"rng.rank0", "rng.rank1"} <= set(keys)
    assert "optimizer.state.layers.0.attention.wq.weight.exp_avg" in keys


@pytest.mark.slow
def test_async_saves_return_before_the_commit_sync_saves_after(runs):
    for name, (_, _, extra) in SOURCES.items():
        seconds = runs["summaries"][name]["checkpoint_seconds"]
        assert len(seconds["blocked"]) == len(seconds["until_commit"]) == STEPS // SAVED_AT, name
        if extra.get("checkpoint_async") is False:
            assert all(c <= b for b, c in zip(seconds["blocked"], seconds["until_commit"])), name
        else:  # training went on while the files were written, hashed and committed
            assert sum(seconds["blocked"]) < sum(seconds["until_commit"]), (name, seconds)


@pytest.mark.slow
def test_load_pretrained_reads_a_training_checkpoint(runs):
    """The weights saved after step 3 give, on step 4's batch, the loss step 4 of the run reported."""
    folder = runs["folder"]
    batch = the_batch(SAVED_AT + 1)
    for source in ("dp2-zero3-recompute", "dp2xpp2"):
        model = fivefold.load_pretrained(str(step_dir(folder / source, SAVED_AT)))
        with torch.no_grad():
            logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
        assert loss == pytest.approx(records(folder, source)[SAVED_AT]["loss"], rel=RTOL), source
    newest = fivefold.load_pretrained(str(folder / "dp2-zero3-recompute"))  # a root: its newest, step 6
    with torch.no_grad():
        assert not torch.equal(newest(batch[:, :-1]), logits)


@pytest.mark.slow
def test_init_from_hf_gives_the_transformers_loss_under_every_plan(runs):
    folder = runs["folder"]
    batch = the_batch(1)
    with torch.no_grad():
        expected = runs["hf_model"](input_ids=batch, labels=batch).loss.item()  # transformers' own loss
    single = records(folder, "hf:single")[0]["loss"]
    assert single == pytest.approx(expected, rel=RTOL)
    for name in HF_PLANS:
        assert records(folder, name)[0]["loss"] == pytest.approx(single, rel=RTOL), name
    # Not the seeded initialisation: those weights give ~ln(256) + 0.05 on this batch.
    assert abs(single - records(folder, "reference")[0]["loss"]) > 0.01
