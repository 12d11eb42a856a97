"""Hugging Face MoE checkpoints: Mixtral and Qwen3-MoE in and out with logits equal to transformers' own
(fp32, 1e-4), built locally from a config (no download); variants fivefold does not implement are refused
in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fivefold
from fivefold.checkpoint import save_model_checkpoint
from fivefold.checkpoint.hf import load_hf_state_dict
from fivefold.cli import main
from fivefold.errors import SpecError
from fivefold.models import MoE, build_model, init_weights
from fivefold.spec import ModelSpec

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts_per_tok=2)


def hf_config(family: str):
    if family == "mixtral":
        return transformers.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, rope_theta=1000.0)
    # head_dim 16 != hidden/heads = 8, first layer dense, top-k weights not renormalised
    return transformers.Qwen3MoeConfig(**COMMON, intermediate_size=80, moe_intermediate_size=24, num_experts=4,
                                       head_dim=16, mlp_only_layers=[0], norm_topk_prob=False, rope_theta=1000.0)


def hf_model(tmp_path: Path, family: str):
    """A tiny random model of `family` saved with save_pretrained (one tensor per expert, as on the Hub)."""
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family)).eval()
    with torch.no_grad():  # random norms and a wider router make the comparison sharper
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            if name.endswith("gate.weight") and param.shape[0] == 4:
                param.normal_(0.0, 0.5)
    folder = tmp_path / family
    model.save_pretrained(folder)
    return model, folder


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_hf_moe_to_fivefold_logits_match(tmp_path, capsys, family):
    reference, folder = hf_model(tmp_path, family)
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    spec, _ = load_hf_state_dict(folder)
    assert (spec.experts, spec.top_k) == (4, 2)
    if family == "qwen3_moe":
        assert (spec.head_dim, spec.qk_norm, spec.router_norm_topk, spec.first_dense_layers) == (16, True, False, 1)
    with torch.no_grad():
        expected = reference(TOKENS).logits
        from_checkpoint = fivefold.load_pretrained(str(tmp_path / "ck"))
        from_folder = fivefold.load_pretrained(str(folder))
        assert max_diff(from_checkpoint(TOKENS), expected) < 1e-4
        assert max_diff(from_folder(TOKENS), expected) < 1e-4
    assert isinstance(from_folder.layers["1"].feed_forward, MoE)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fivefold_moe_to_hf_logits_match(tmp_path, capsys, family):
    qwen = family == "qwen3_moe"
    spec = ModelSpec(name="m", layers=3, hidden=32, heads=4, kv_heads=2, head_dim=16 if qwen else 0, qk_norm=qwen,
                     ffn_hidden=64, vocab=96, max_seq_len=64, experts=4, top_k=2, expert_ffn_hidden=24,
                     router_norm_topk=not qwen, first_dense_layers=1 if qwen else 0, aux_loss_coef=0.01)
    model = build_model(spec, device="cpu")
    init_weights(model, seed=5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "router" in name:
                param.normal_(0.0, 0.5)
    path = save_model_checkpoint(model.state_dict(), spec, tmp_path / "ck")
    assert main(["convert", "--to-hf", str(path), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == family
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded).__name__ == ("Qwen3MoeForCausalLM" if qwen else "MixtralForCausalLM")
    with torch.no_grad():
        assert max_diff(loaded(TOKENS).logits, model.eval()(TOKENS)) < 1e-4


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 64},
     "config.json:model_type='qwen2_moe': Qwen2-MoE's shared expert is scaled by its own sigmoid gate"),
    ({"sliding_window": 4096}, "config.json:sliding_window=4096: sliding-window attention is not imported"),
    ({"router_jitter_noise": 0.1}, "config.json:router_jitter_noise=0.1: router noise is not implemented"),
])
def test_unsupported_moe_variants_are_one_line(tmp_path, capsys, change, message):
    _, folder = hf_model(tmp_path, "mixtral")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_hf_state_dict(folder)
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_models_without_an_hf_family_are_refused_before_reading(tmp_path):
    spec = ModelSpec(layers=1, hidden=32, heads=4, vocab=64, max_seq_len=32, experts=4, top_k=2, shared_experts=1)
    model = build_model(spec, device="cpu")
    path = save_model_checkpoint(model.state_dict(), spec, tmp_path / "ck")
    with pytest.raises(SpecError, match="model.shared_experts=1: neither Mixtral nor Qwen3-MoE"):
        fivefold.checkpoint.hf.convert_to_hf(path, tmp_path / "out")
