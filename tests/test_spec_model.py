"""ModelSpec: presets, derived defaults, the three ways to name a model, and every error path."""

import pytest

from fivefold.errors import SpecError
from fivefold.spec import PRESETS, ModelSpec, parse_model
from fivefold.spec.model import llama_ffn_hidden


def test_presets_have_published_sizes():
    # Parameter counts as published: Llama 3 8B/70B/405B, GPT-3 175B, Mixtral 46.7B total.
    expected_billions = {"llama3-8b": 8.03, "llama3-70b": 70.55, "llama3-405b": 405.85, "gpt3-175b": 174.6,
                         "mixtral-8x7b": 46.70}
    for name, billions in expected_billions.items():
        assert PRESETS[name].num_params() / 1e9 == pytest.approx(billions, rel=0.01), name


def test_moe_presets_have_published_total_and_active_sizes():
    # Total / active parameters as the model cards state them: Mixtral 46.7B/12.9B, Qwen3 30.5B/3.3B and
    # 235B/22B, gpt-oss-120b 116.8B total.
    expected = {"mixtral-8x7b": (46.70, 12.9), "qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235.1, 22.2)}
    for name, (total, active) in expected.items():
        model = PRESETS[name]
        assert model.num_params() / 1e9 == pytest.approx(total, rel=0.01), name
        assert model.active_params_per_token() / 1e9 == pytest.approx(active, rel=0.02), name
    assert PRESETS["gpt-oss-120b"].num_params() / 1e9 == pytest.approx(116.8, rel=0.01)
    qwen = PRESETS["qwen3-30b-a3b"]
    assert (qwen.head_dim, qwen.qk_norm, qwen.heads * qwen.head_dim, qwen.hidden) == (128, True, 4096, 2048)
    tiny = PRESETS["tiny-moe"]
    assert (tiny.layers, tiny.hidden, tiny.experts, tiny.top_k, tiny.moe_layers) == (4, 64, 4, 2, 4)


def test_moe_layer_selection_and_head_dim_default():
    model = ModelSpec(layers=6, hidden=64, heads=4, experts=4, top_k=2, first_dense_layers=1, moe_every=2)
    assert [model.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    dense, moe = model.params_per_layer(False), model.params_per_layer(True)
    assert model.layer_params_total() == 3 * dense + 3 * moe
    assert ModelSpec(layers=2, hidden=64, heads=4).head_dim == 16
    wide = parse_model("layers=2,hidden=64,heads=4,head_dim=32,qk_norm=true")
    assert wide.head_dim == 32 and wide.params_per_layer() == ModelSpec(layers=2, hidden=64, heads=4).params_per_layer() \
        + 4 * 64 * (128 - 64) + 2 * 32  # q, k, v, o twice as wide, plus the two per-head norms
    assert parse_model("preset=tiny,hidden=128").head_dim == 32  # derived head_dim follows hidden


def test_tiny_and_small_are_cpu_sized():
    assert PRESETS["tiny"].num_params() < 1_000_000
    assert PRESETS["small"].num_params() < 20_000_000


def test_derived_defaults():
    gpt = ModelSpec(layers=2, hidden=64, heads=4, mlp="gelu", norm="layernorm", position="learned")
    assert gpt.ffn_hidden == 256 and gpt.kv_heads == 4
    llama = ModelSpec(layers=2, hidden=4096, heads=32)
    assert llama.ffn_hidden == llama_ffn_hidden(4096) == 11008  # Llama 2 7B's width
    assert llama_ffn_hidden(4096, multiple_of=1024, multiplier=1.3) == 14336  # Llama 3 8B's width
    moe = ModelSpec(layers=2, hidden=64, heads=4, experts=4, top_k=2, ffn_hidden=96)
    assert moe.expert_ffn_hidden == 96


def test_parse_preset_inline_and_toml(tmp_path):
    assert parse_model("llama3-8b") is PRESETS["llama3-8b"]
    inline = parse_model("layers=96,hidden=12288,heads=96,vocab=51200,mlp=gelu")
    assert (inline.layers, inline.hidden, inline.heads, inline.vocab, inline.mlp) == (96, 12288, 96, 51200, "gelu")
    assert inline.ffn_hidden == 4 * 12288
    based = parse_model("preset=llama3-8b,layers=4")
    assert based.layers == 4 and based.hidden == 4096 and based.ffn_hidden == 14336
    path = tmp_path / "m.toml"
    path.write_text('[model]\nlayers = 3\nhidden = 128\nheads = 8\nkv_heads = 2\nvocab = 1000\n'
                    'tied_embeddings = true\n')
    from_file = parse_model(str(path))
    assert (from_file.layers, from_file.kv_heads, from_file.tied_embeddings) == (3, 2, True)


def test_changing_hidden_recomputes_derived_width():
    model = parse_model("preset=tiny-gpt,hidden=128")
    assert model.ffn_hidden == 512


@pytest.mark.parametrize("text, field, words", [
    ("gpt5", "--model", "known: tiny"),
    ("layers=2,hidden=64,heads=6", "model.hidden", "divisible by heads=6"),
    ("layers=2,hidden=64,heads=4,kv_heads=3", "model.kv_heads", "valid: 1, 2, 4"),
    ("layers=-1,hidden=64,heads=4", "model.layers", "positive integer"),
    ("layers=0,hidden=64,heads=4", "model.layers", "positive integer"),
    ("layers=2,hidden=64,heads=4,mlp=relu", "model.mlp", "gelu, swiglu"),
    ("layers=2,hidden=64,heads=4,norm=batchnorm", "model.norm", "layernorm, rmsnorm"),
    ("layers=2,hidden=64,heads=4,position=alibi", "model.position", "learned, rope"),
    ("layers=2,hidden=64,heads=4,colour=red", "model.colour", "unknown field"),
    ("layers=two,hidden=64,heads=4", "model.layers", "expected an integer"),
    ("layers=2,,hidden=64", "--model", "malformed item"),
    ("layers=2,hidden=64,heads=4,experts=4,top_k=5", "model.top_k", "between 1 and experts=4"),
    ("layers=2,hidden=64,heads=4,top_k=2", "model.top_k", "only MoE"),
    ("layers=2,hidden=60,heads=4", "model.hidden", "even head size"),
    ("layers=2,hidden=64,heads=4,head_dim=15", "model.head_dim", "even head size"),
    ("layers=2,hidden=64,heads=4,head_dim=-2", "model.head_dim", "positive integer"),
    ("preset=tiny-moe,router=sigmoid", "model.router", "softmax"),
    ("preset=tiny-moe,aux_loss_coef=-1", "model.aux_loss_coef", ">= 0"),
    ("preset=tiny-moe,first_dense_layers=4", "model.first_dense_layers", "between 0 and layers-1=3"),
    ("preset=tiny-moe,moe_every=0", "model.moe_every", "positive integer"),
    ("preset=tiny-moe,moe_every=5", "model.moe_every", "no MoE layer"),
    ("layers=2,hidden=64,heads=4,shared_experts=1", "model.shared_experts", "only MoE"),
    ("preset=gpt9,layers=2", "model.preset", "unknown preset"),
    ("layers=2,hidden=64,heads=4,tied_embeddings=maybe", "model.tied_embeddings", "expected true or false"),
])
def test_model_errors_name_field_value_and_fix(text, field, words):
    with pytest.raises(SpecError) as info:
        parse_model(text)
    assert info.value.field == field
    assert words in str(info.value)
    assert "\n" not in str(info.value)


def test_model_file_errors(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        parse_model(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("layers = [")
    with pytest.raises(SpecError, match="not valid TOML"):
        parse_model(str(bad))
