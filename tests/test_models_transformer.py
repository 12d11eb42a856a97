"""fivefold.models: plan-independent init, deterministic forward, pipeline-stage composition, HF parity."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fivefold.models import build_model, init_weights, stable_seed
from fivefold.spec import PRESETS, ModelSpec

TINY = ModelSpec(name="t", layers=3, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64, max_seq_len=32)
TINY_GPT = ModelSpec(name="tg", layers=3, hidden=32, heads=4, mlp="gelu", norm="layernorm", position="learned",
                     vocab=64, max_seq_len=32)


def materialised(spec: ModelSpec, seed: int = 0):
    model = build_model(spec)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return model


def make_stage(spec: ModelSpec, keep_layers: list[int], first: bool, last: bool, seed: int = 0):
    """A pipeline stage the way the runtime makes one: delete what it does not own, on meta, then init."""
    model = build_model(spec)
    for key in list(model.layers.keys()):
        if int(key) not in keep_layers:
            del model.layers[key]
    if not first:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return model


def test_stable_seed_is_fixed_across_runs():
    # The documented recipe (first 8 bytes of SHA-256 of "seed:name", little endian, 63 bits): if it
    # changed, every initial model would change with it.
    import hashlib
    digest = hashlib.sha256(b"0:layers.0.attention.wq.weight").digest()
    assert stable_seed(0, "layers.0.attention.wq.weight") == int.from_bytes(digest[:8], "little") & (2**63 - 1)
    assert stable_seed(0, "a") != stable_seed(1, "a")
    assert stable_seed(0, "a") != stable_seed(0, "b")
    assert 0 <= stable_seed(7, "x") < 2**63


@pytest.mark.parametrize("spec", [TINY, TINY_GPT], ids=["llama", "gpt"])
def test_parameter_count_matches_spec(spec):
    model = build_model(spec)  # meta: free to count
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("spec", [TINY, TINY_GPT], ids=["llama", "gpt"])
def test_meta_then_init_equals_direct_cpu_build(spec):
    on_meta = materialised(spec, seed=3)
    direct = build_model(spec, device="cpu")
    init_weights(direct, 3)
    a, b = on_meta.state_dict(), direct.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("spec", [TINY, TINY_GPT], ids=["llama", "gpt"])
def test_stage_with_deleted_layers_has_the_full_models_weights(spec):
    full = materialised(spec).state_dict()
    first = make_stage(spec, [0], first=True, last=False)
    last = make_stage(spec, [1, 2], first=False, last=True)
    assert set(first.layers.keys()) == {"0"} and set(last.layers.keys()) == {"1", "2"}
    stage_names = set(first.state_dict()) | set(last.state_dict())
    assert stage_names == set(full)  # FQNs unchanged by the split
    for stage in (first, last):
        for name, tensor in stage.state_dict().items():
            assert torch.equal(tensor, full[name]), name


def test_stages_composed_give_the_full_models_logits():
    full = materialised(TINY_GPT)
    first = make_stage(TINY_GPT, [0], first=True, last=False)
    last = make_stage(TINY_GPT, [1, 2], first=False, last=True)
    tokens = torch.randint(0, TINY_GPT.vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    hidden = first(tokens)
    assert hidden.shape == (2, 12, TINY_GPT.hidden)
    torch.testing.assert_close(last(hidden), full(tokens), rtol=0, atol=0)


def test_init_scheme_values():
    model = materialised(TINY_GPT, seed=0)
    layer = model.layers["1"]
    assert torch.equal(layer.attention_norm.weight, torch.ones(32))
    assert torch.equal(layer.attention_norm.bias, torch.zeros(32))
    assert torch.equal(layer.attention.wq.bias, torch.zeros(32))
    assert torch.equal(layer.feed_forward.w1.bias, torch.zeros(128))
    # normal(0, 0.02) for linear and embedding weights; residual outputs 0.02/sqrt(2*layers).
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.feed_forward.w1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.feed_forward.w2.weight.std().item() == pytest.approx(0.02 / math.sqrt(6), rel=0.05)
    # Each tensor gets its own stream: two same-shape weights differ.
    assert not torch.equal(model.layers["0"].attention.wq.weight, layer.attention.wq.weight)
    # Llama-style MoE models (RoPE, untied): token embeddings at std 1 (models/init.py EMBEDDING_STD), the rest as
    # above; dense and tied ones keep 0.02.
    moe = dataclasses.replace(TINY, experts=4, top_k=2, expert_ffn_hidden=32)
    llama_moe = materialised(moe, seed=0)
    assert llama_moe.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert llama_moe.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert materialised(TINY, seed=0).tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    tied = materialised(dataclasses.replace(moe, tied_embeddings=True), seed=0)
    assert tied.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_seed_changes_weights():
    a, b = materialised(TINY, 0), materialised(TINY, 1)
    assert not torch.equal(a.output.weight, b.output.weight)


def test_tied_embeddings_stay_tied_after_to_empty():
    spec = ModelSpec(layers=1, hidden=32, heads=4, vocab=64, tied_embeddings=True, max_seq_len=32)
    model = materialised(spec)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    # A stage holding only the head draws the same matrix as the embedding.
    head_only = make_stage(spec, [0], first=False, last=True)
    assert torch.equal(head_only.output.weight, model.tok_embeddings.weight)


@pytest.mark.parametrize("spec", [TINY, TINY_GPT], ids=["llama", "gpt"])
def test_forward_is_deterministic(spec):
    tokens = torch.randint(0, spec.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    first = materialised(spec)(tokens)
    second = materialised(spec)(tokens)
    assert first.shape == (2, 16, spec.vocab)
    assert torch.equal(first, second)
    # Causal: the logits of a prefix do not depend on the tokens after it.
    prefix = materialised(spec)(tokens[:, :9])
    torch.testing.assert_close(prefix, first[:, :9], rtol=1e-5, atol=1e-6)


def test_presets_build_on_meta_without_memory():
    model = build_model(PRESETS["llama3-8b"])  # 8B parameters: only possible because nothing is allocated
    assert sum(p.numel() for p in model.parameters()) == PRESETS["llama3-8b"].num_params()
    for name in ("qwen3-30b-a3b", "mixtral-8x7b"):  # MoE, head_dim != hidden/heads, q/k norms
        model = build_model(PRESETS[name])
        assert sum(p.numel() for p in model.parameters()) == PRESETS[name].num_params(), name


def test_dtensor_shards_get_their_slice_of_the_full_init():
    """A TP/FSDP-sharded parameter receives exactly its rows/columns of the unsharded init."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    full = materialised(TINY, seed=5).state_dict()
    # The fake backend plays rank 1 of a 2-rank world in this process with no communication. Only one
    # rank per process: DTensor caches sharding decisions keyed by meshes that compare equal across ranks.
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = build_model(TINY)
        model.to_empty(device="cpu")
        attention = model.layers["1"].attention
        attention.wq.weight = torch.nn.Parameter(
            distribute_tensor(attention.wq.weight.detach(), mesh, [Shard(0)], src_data_rank=None))
        attention.wo.weight = torch.nn.Parameter(
            distribute_tensor(attention.wo.weight.detach(), mesh, [Shard(1)], src_data_rank=None))
        init_weights(model, 5)
        second_half = slice(16, 32)
        torch.testing.assert_close(attention.wq.weight.to_local(),
                                   full["layers.1.attention.wq.weight"][second_half], rtol=0, atol=0)
        torch.testing.assert_close(attention.wo.weight.to_local(),
                                   full["layers.1.attention.wo.weight"][:, second_half], rtol=0, atol=0)
        torch.testing.assert_close(model.output.weight, full["output.weight"], rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_llama_matches_transformers_logits():
    transformers = pytest.importorskip("transformers")
    from fivefold.checkpoint.hf import from_hf_name, spec_from_hf_config

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    spec = spec_from_hf_config(config.to_dict())
    assert (spec.kv_heads, spec.ffn_hidden, spec.rope_theta) == (2, 80, 500.0)
    model = build_model(spec)
    model.to_empty(device="cpu")
    state = {from_hf_name(k): v for k, v in reference.state_dict().items() if from_hf_name(k)}
    assert set(state) == set(model.state_dict())
    model.load_state_dict(state)
    tokens = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model(tokens)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_build_matches_cpu():
    cpu = materialised(TINY, seed=4)
    model = build_model(TINY)
    model.to_empty(device="cuda")
    init_weights(model, 4)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor.cpu(), cpu.state_dict()[name]), name
    tokens = torch.randint(0, TINY.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(tokens.cuda()).cpu(), cpu(tokens), rtol=1e-4, atol=1e-4)
