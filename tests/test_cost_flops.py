"""FLOP counts: Narayanan et al. 2021 eq. (3) and the per-layer counts the cost model uses."""

import pytest

from fivefold.cost.flops import (hardware_flops_per_step, linear_flops_per_token, model_flops_per_step,
                                 narayanan_flops)
from fivefold.spec import PRESETS, ModelSpec, TrainSpec


def gpt(layers, hidden, heads, vocab=51200, seq=2048):
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, mlp="gelu", norm="layernorm", position="learned",
                     vocab=vocab, max_seq_len=seq, tied_embeddings=True)


def test_narayanan_eq3_by_hand_for_gpt3():
    # GPT-3 175B, one sequence of 2048 tokens: 72 B s l h^2 (1 + s/6h + V/12lh).
    by_hand = 72 * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288) + 51200 / (12 * 96 * 12288))
    assert narayanan_flops(1, 2048, 96, 12288, 51200, recompute=False) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(2.2045e15, rel=1e-4)
    # With full recompute the layers run forward twice: 96 B s l h^2 (1 + s/6h + V/16lh).
    with_recompute = 96 * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288) + 51200 / (16 * 96 * 12288))
    assert narayanan_flops(1, 2048, 96, 12288, 51200, recompute=True) == pytest.approx(with_recompute, rel=1e-12)


@pytest.mark.parametrize("layers, hidden, heads, batch", [(96, 12288, 96, 1536), (30, 3072, 32, 512),
                                                          (128, 25600, 160, 3072)])
def test_model_flops_of_a_gpt_equal_eq3(layers, hidden, heads, batch):
    model = gpt(layers, hidden, heads)
    train = TrainSpec(seq_len=2048, global_batch=batch)
    assert model_flops_per_step(model, train) == pytest.approx(
        narayanan_flops(batch, 2048, layers, hidden, 51200, recompute=False), rel=1e-12)
    assert hardware_flops_per_step(model, train, "full") == pytest.approx(
        narayanan_flops(batch, 2048, layers, hidden, 51200, recompute=True), rel=1e-12)


def test_gqa_and_swiglu_weights_per_token():
    # Llama 3 8B: h=4096, 8 KV heads of 128 (kv width 1024), SwiGLU width 14336.
    h, kv, ffn = 4096, 1024, 14336
    assert linear_flops_per_token(PRESETS["llama3-8b"]) == 2 * (h * (h + 2 * kv) + h * h) + 2 * 3 * h * ffn
    assert linear_flops_per_token(PRESETS["llama3-8b"]) == 436_207_616


def test_moe_counts_top_k_experts_and_the_router():
    # Mixtral 8x7B: each token runs 2 of 8 SwiGLU experts, plus an h x 8 router.
    h, kv, ffn = 4096, 1024, 14336
    attention = 2 * (h * (h + 2 * kv) + h * h)
    assert linear_flops_per_token(PRESETS["mixtral-8x7b"]) == attention + 2 * 2 * 3 * h * ffn + 2 * h * 8
    assert linear_flops_per_token(PRESETS["mixtral-8x7b"]) == 788_594_688


def test_selective_recompute_repeats_only_attention_scores():
    model, train = PRESETS["llama3-8b"], TrainSpec(seq_len=8192, global_batch=4)
    extra = hardware_flops_per_step(model, train, "selective") - model_flops_per_step(model, train)
    assert extra == pytest.approx(32 * 4 * 8192 * 4 * 8192 * 4096, rel=1e-12)  # l * tokens * 4 s h
