"""Expert parallelism computes the same training run: tiny-moe, 5 fp32 steps on CPU/gloo, loss, global
gradient norm, auxiliary loss and expert load match the single-process run within 1e-5 relative under ep
folded over dp (with ZeRO, pp and tp) and over dp x cp (auxiliary loss off: the runtime refuses it with cp), and a
checkpoint resumes across an ep change (ep2 -> ep1,
ep1 -> ep4) within 1e-5.

One launch per world size (as in test_parity_plans.py); the resumes run after their sources in it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fivefold.checkpoint import step_dir
from fivefold.runtime import RunConfig, launch
from fivefold.spec import PRESETS, ModelSpec, Plan, TrainSpec, parse_cluster

STEPS, SAVED_AT, RTOL = 5, 3, 1e-5
MODEL = PRESETS["tiny-moe"]
# Qwen3-style attention: heads wider than hidden/heads and per-head q/k norms, under tp.
QK_MODEL = ModelSpec(name="tiny-moe-qk", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, qk_norm=True,
                     vocab=256, max_seq_len=256, experts=4, top_k=2, expert_ffn_hidden=64, aux_loss_coef=0.01)

# name -> plan fields (world 4 unless the name says otherwise)
PLANS: dict[str, dict] = {
    "dp4-ep1": dict(dp=4, micro_batch=2),
    "dp4-ep2": dict(dp=4, ep=2, micro_batch=2),
    "dp4-ep4-zero1": dict(dp=4, ep=4, zero=1, micro_batch=1),
    "dp4-ep2-zero3": dict(dp=4, ep=2, zero=3, micro_batch=1),
    "dp4-ep2-zero2-recompute": dict(dp=4, ep=2, zero=2, micro_batch=2, recompute="full"),
    "dp2xpp2-ep2-1f1b": dict(dp=2, pp=2, ep=2, schedule="1f1b", micro_batch=2),
    "dp2xpp2-ep2-gpipe-zero3": dict(dp=2, pp=2, ep=2, zero=3, schedule="gpipe", micro_batch=2),
    "dp2xpp2-ep2-interleaved": dict(dp=2, pp=2, ep=2, zero=1, schedule="interleaved-1f1b", virtual_stages=2,
                                    micro_batch=2),
    "dp2xpp2-ep2-zbv": dict(dp=2, pp=2, ep=2, zero=2, schedule="zbv", virtual_stages=2, micro_batch=2),
    "dp2xtp2-ep2-sp": dict(dp=2, tp=2, ep=2, sequence_parallel=True, micro_batch=2),
}
# ep folded over dp x cp: the runtime refuses the auxiliary loss with cp > 1, so these train a model without it.
NO_AUX_MODEL = replace(MODEL, name="tiny-moe-noaux", aux_loss_coef=0.0)
CP_PLANS: dict[str, dict] = {
    "cp:dp2xcp2-ep4-zero3": dict(dp=2, cp=2, ep=4, zero=3, micro_batch=2),
    "cp:dp2xcp2-ep2-ulysses": dict(dp=2, cp=2, ep=2, cp_method="ulysses", micro_batch=2),
}
RESUMES = {"ep2 -> ep1": ("dp4-ep2", 1, {}), "ep1 -> ep4": ("dp4-ep1", 4, dict(dp=4, ep=4, micro_batch=2))}


TRAIN = TrainSpec(seq_len=32, global_batch=8, dtype="fp32")


def make_plan(world: int, model: ModelSpec = MODEL, **fields) -> Plan:
    return Plan(model=model, cluster=parse_cluster(f"1x{world}xcpu"), train=TRAIN, **fields)


def hf_mixtral(folder: Path):
    """A random MixtralForCausalLM of tiny-moe's shape saved locally; its ModelSpec."""
    import torch
    import transformers

    from fivefold.checkpoint.hf import read_hf_config

    config = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    torch.manual_seed(4)
    transformers.MixtralForCausalLM(config).save_pretrained(folder)
    return read_hf_config(folder)[1]


def config(folder: Path, name: str, plan: Plan, **fields) -> RunConfig:
    return RunConfig(plan.to_toml(), steps=STEPS, seed=0, device="cpu", show_progress=False,
                     metrics_file=str(folder / f"{name}.jsonl"), **fields)


def records(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("moe")
    world4 = [config(folder, name, make_plan(4, **fields), checkpoint_dir=str(folder / name),
                     checkpoint_every=SAVED_AT) for name, fields in PLANS.items()]
    world4 += [config(folder, name, make_plan(world, **fields), resume_from=str(step_dir(folder / source, SAVED_AT)))
               for name, (source, world, fields) in RESUMES.items() if world == 4]
    hf_spec = hf_mixtral(folder / "hf")
    world4.append(config(folder, "hf:dp4-ep2", Plan(model=hf_spec, cluster=parse_cluster("1x4xcpu"), train=TRAIN,
                                                     dp=4, ep=2, micro_batch=2), init_from_hf=str(folder / "hf")))
    world4.append(config(folder, "qk:dp2xtp2-ep2-sp", make_plan(4, QK_MODEL, dp=2, tp=2, ep=2, sequence_parallel=True,
                                                                micro_batch=2)))
    world4 += [config(folder, name, make_plan(4, NO_AUX_MODEL, **fields)) for name, fields in CP_PLANS.items()]
    launch(world4, 4)
    world1 = [config(folder, "reference", make_plan(1)), config(folder, "qk:reference", make_plan(1, QK_MODEL)),
              config(folder, "cp:reference", make_plan(1, NO_AUX_MODEL))]
    world1 += [config(folder, name, make_plan(world, **fields), resume_from=str(step_dir(folder / source, SAVED_AT)))
               for name, (source, world, fields) in RESUMES.items() if world == 1]
    launch(world1, 1)
    return folder


def assert_same_run(expected: list[dict], got: list[dict], name: str) -> None:
    for ref, rec in zip(expected, got, strict=True):
        for key in ("loss", "grad_norm", "aux_loss", "expert_load_max_over_mean"):
            assert rec[key] == pytest.approx(ref[key], rel=RTOL), (name, rec["step"], key)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_expert_parallel_matches_single_process(folder, name):
    assert_same_run(records(folder, "reference"), records(folder, name), name)


@pytest.mark.slow
def test_head_dim_and_qk_norm_under_tp_and_ep(folder):
    assert_same_run(records(folder, "qk:reference"), records(folder, "qk:dp2xtp2-ep2-sp"), "qk")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CP_PLANS))
def test_expert_parallel_folded_over_context_parallel_matches_single_process(folder, name):
    assert_same_run(records(folder, "cp:reference"), records(folder, name), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_across_an_ep_change(folder, name):
    resumed = records(folder, name)
    assert [r["step"] for r in resumed] == list(range(SAVED_AT + 1, STEPS + 1))
    assert_same_run(records(folder, "reference")[SAVED_AT:], resumed, name)
    assert_same_run(records(folder, RESUMES[name][0])[SAVED_AT:], resumed, name)


@pytest.mark.slow
def test_reference_learns_with_aux_loss_and_load_metrics(folder):
    reference = records(folder, "reference")
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.3
    # 4 MoE layers, coefficient 0.01, top-2: a balanced router scores 0.01 * 2 per layer (mean over layers).
    assert reference[0]["aux_loss"] == pytest.approx(0.02, rel=0.1)
    assert all(1.0 <= r["expert_load_max_over_mean"] < 4.0 for r in reference)
    assert len(reference[0]["expert_load_per_layer"]) == 4


@pytest.mark.slow
def test_init_from_hf_under_ep_gives_the_transformers_loss(folder):
    import torch
    import transformers

    from fivefold.data import GlobalBatchLoader, load_tokenizer, open_dataset

    batch = GlobalBatchLoader(open_dataset(None, load_tokenizer(None)), 32, 8, seed=0).next_batch()
    model = transformers.MixtralForCausalLM.from_pretrained(folder / "hf").eval()
    with torch.no_grad():
        expected = model(input_ids=batch, labels=batch).loss.item()
    assert records(folder, "hf:dp4-ep2")[0]["loss"] == pytest.approx(expected, rel=RTOL)
