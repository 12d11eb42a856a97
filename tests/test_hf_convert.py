"""Hugging Face Llama import/export: logits parity with transformers both ways, sharded files, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fivefold
from fivefold.checkpoint import save_model_checkpoint
from fivefold.checkpoint.hf import load_hf_state_dict, spec_from_hf_config
from fivefold.cli import main
from fivefold.errors import SpecError
from fivefold.models import build_model, init_weights
from fivefold.spec import ModelSpec

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


def hf_llama(tmp_path: Path, name: str = "hf", tied: bool = False, shard: str | None = None):
    """A tiny random LlamaForCausalLM saved with save_pretrained (no download)."""
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, rope_theta=1000.0, tie_word_embeddings=tied)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF zero/one-initialises norms; random ones make the parity test sharper
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.weight.uniform_(0.5, 1.5)
    folder = tmp_path / name
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model, folder


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_hf_to_fivefold_logits_match(tmp_path, capsys):
    reference, folder = hf_llama(tmp_path)
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "ck")]) == 0
    assert "wrote fivefold checkpoint" in capsys.readouterr().out
    with torch.no_grad():
        expected = reference(TOKENS).logits
        from_checkpoint = fivefold.load_pretrained(str(tmp_path / "ck"))(TOKENS)
        from_folder = fivefold.load_pretrained(str(folder))(TOKENS)
    assert max_diff(from_checkpoint, expected) < 1e-4
    assert max_diff(from_folder, expected) < 1e-4


def test_fivefold_to_hf_logits_match(tmp_path, capsys):
    spec = ModelSpec(name="t", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=80, vocab=96, max_seq_len=64,
                     rope_theta=1000.0)
    model = build_model(spec)
    model.to_empty(device="cpu")
    init_weights(model, 7)
    save_model_checkpoint(model.state_dict(), spec, tmp_path / "run" / "step-00000003", step=3)
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == ["config.json", "model.safetensors"] and report["params"] == spec.num_params()
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert max_diff(exported(TOKENS).logits, model(TOKENS)) < 1e-4


def test_sharded_checkpoint_with_index(tmp_path):
    reference, folder = hf_llama(tmp_path, shard="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    spec, state = load_hf_state_dict(folder)
    assert spec.layers == 2 and spec.kv_heads == 2 and spec.rope_theta == 1000.0
    hf_state = reference.state_dict()
    assert torch.equal(state["layers.1.feed_forward.w3.weight"], hf_state["model.layers.1.mlp.up_proj.weight"])
    with torch.no_grad():
        assert max_diff(fivefold.load_pretrained(str(folder))(TOKENS), reference(TOKENS).logits) < 1e-4


def test_tied_embeddings_round_trip(tmp_path):
    reference, folder = hf_llama(tmp_path, tied=True)
    spec, state = load_hf_state_dict(folder)
    assert spec.tied_embeddings and state["output.weight"] is state["tok_embeddings.weight"]
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "ck")]) == 0
    model = fivefold.load_pretrained(str(tmp_path / "ck"))
    assert model.output.weight is model.tok_embeddings.weight
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert max_diff(again(TOKENS).logits, reference(TOKENS).logits) < 1e-4


def test_missing_shard_is_named(tmp_path):
    _, folder = hf_llama(tmp_path, shard="20KB")
    victim = sorted(folder.glob("model-*.safetensors"))[-1]
    victim.unlink()
    before = snapshot(folder)
    with pytest.raises(SpecError, match=rf"{victim.name}='missing': this shard is listed in "
                                        r"model.safetensors.index.json"):
        load_hf_state_dict(folder)
    assert snapshot(folder) == before


def test_truncated_safetensors_is_named(tmp_path):
    _, folder = hf_llama(tmp_path)
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[:5000])
    before = snapshot(folder)
    with pytest.raises(SpecError, match=r"model.safetensors='5000 bytes': truncated or not a safetensors file"):
        fivefold.load_pretrained(str(folder))
    assert snapshot(folder) == before


def test_shape_mismatch_names_tensor_and_file(tmp_path):
    _, folder = hf_llama(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match=r"model.safetensors:model.layers.0.mlp.down_proj.weight=\[32, 80\]: "
                                        r"config.json implies shape \[32, 96\]"):
        load_hf_state_dict(folder)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, r"config.json:model_type='gpt2'"),
    ({"model_type": "mistral"}, r"config.json:model_type='mistral': only Llama checkpoints"),
    ({"architectures": ["LlamaForSequenceClassification"]}, r"config.json:architectures=\["),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0, "factor": 8.0}},
     r"rope_parameters.rope_type='llama3': only default RoPE"),
])
def test_unsupported_configs_are_refused(tmp_path, change, message):
    _, folder = hf_llama(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match=message):
        load_hf_state_dict(folder)


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    _, folder = hf_llama(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"],
                                                   "model_type": "gpt2"}))
    capsys.readouterr()  # drop transformers' progress bars
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "config.json:model_type='gpt2'" in err
    assert not (tmp_path / "ck").exists()  # nothing written on failure
    assert main(["convert", "--out", str(tmp_path / "x")]) == 2
    assert "give exactly one of the two" in capsys.readouterr().err


def test_gpt_style_model_cannot_be_exported(tmp_path):
    spec = ModelSpec(layers=1, hidden=32, heads=4, mlp="gelu", norm="layernorm", position="learned", vocab=64,
                     max_seq_len=32)
    model = build_model(spec, device="cpu")
    path = save_model_checkpoint(model.state_dict(), spec, tmp_path / "ck")
    before = snapshot(path)
    with pytest.raises(SpecError, match="only Llama-style models"):
        fivefold.checkpoint.hf.convert_to_hf(path, tmp_path / "out")
    assert snapshot(path) == before


def test_spec_from_config_reads_legacy_rope_theta():
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_attention_heads": 8, "num_hidden_layers": 2, "intermediate_size": 172, "vocab_size": 100,
              "rope_theta": 500000.0, "num_key_value_heads": 2}
    spec = spec_from_hf_config(config)
    assert (spec.rope_theta, spec.kv_heads, spec.head_dim, spec.norm_eps) == (500000.0, 2, 8, 1e-6)
    with pytest.raises(SpecError, match=r"config.json:vocab_size=None: required field"):
        spec_from_hf_config({k: v for k, v in config.items() if k != "vocab_size"})
