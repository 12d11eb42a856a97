"""The MoE block: top-k routing equals a token-by-token reference, routing stays fp32, the auxiliary loss
has its published value and splits over sequences exactly, the aux-free bias steers selection, and
head_dim/qk_norm attention runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fivefold.models import MoE, build_model, init_weights
from fivefold.spec import PRESETS, ModelSpec

SPEC = ModelSpec(layers=2, hidden=32, heads=4, experts=4, top_k=2, expert_ffn_hidden=48, aux_loss_coef=0.01)


def materialised_moe(spec: ModelSpec = SPEC, seed: int = 0) -> MoE:
    model = build_model(spec)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return model.layers["0"].feed_forward


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-k, renormalise, sum of weighted expert MLPs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = (moe.router.weight.double() @ x[t].double()).softmax(-1)
        weights, chosen = probs.topk(moe.top_k)
        weights = weights / weights.sum()
        for w, e in zip(weights, chosen):
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            out[t] += (w * (w2 @ (F.silu(w1 @ x[t]) * (w3 @ x[t])))).float()
    return out


def test_routed_output_equals_token_by_token_reference():
    moe = materialised_moe()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = moe(x)
    torch.testing.assert_close(got.view(10, 32), reference(moe, x.view(10, 32)), rtol=1e-5, atol=1e-6)


def test_routing_is_fp32_under_bf16_inputs():
    moe = materialised_moe()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    captured = []
    original = F.linear

    def spy(inp, weight, bias=None):
        captured.append((inp.dtype, weight.dtype))
        return original(inp, weight, bias)

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(F, "linear", spy)
        moe.to(torch.bfloat16)(x.to(torch.bfloat16).view(4, 16, 32))
    assert captured[0] == (torch.float32, torch.float32)


def test_aux_loss_value_gradient_and_sequence_split():
    moe = materialised_moe()
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    # Perfect balance gives coef * top_k (Switch/Mixtral normalisation); this router is near it.
    moe.aux_loss_scale = 1.0 / 4  # one MoE layer here for the value check: mean over 4 sequences
    moe(x).sum().backward()
    _, aux = moe.take_stats()
    assert 0.01 * 2 <= aux < 0.01 * 2 * 1.2
    # The auxiliary loss reaches the router through backward even when the output's gradient is zero.
    moe.zero_grad()
    (moe(x) * 0).sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0
    # Per-sequence: two halves with the global scale add up to the whole batch.
    moe.take_stats()
    moe.aux_loss_scale = 1.0 / (2 * 4)
    whole = moe.aux_loss(*route(moe, x), 4, 8)
    halves = sum(moe.aux_loss(*route(moe, part), 2, 8) for part in x.split(2))
    assert halves.item() == pytest.approx(whole.item(), rel=1e-6)


def route(moe: MoE, x: torch.Tensor):
    scores = F.linear(x.reshape(-1, 32).float(), moe.router.weight).softmax(-1)
    return scores, scores.topk(moe.top_k, dim=-1).indices


def test_expert_load_is_counted_once_per_token_copy():
    moe = materialised_moe()
    x = torch.randn(3, 7, 32, requires_grad=True)
    moe(x).sum().backward()
    load, _ = moe.take_stats()
    assert load.sum().item() == 3 * 7 * 2
    assert moe.take_stats()[0].sum().item() == 0  # reset


def test_aux_free_bias_steers_selection_not_weights():
    spec = ModelSpec(layers=1, hidden=32, heads=4, experts=4, top_k=1, expert_ffn_hidden=16, router_bias_rate=1e-3)
    moe = materialised_moe(spec)
    assert torch.equal(moe.expert_bias, torch.zeros(4))
    x = torch.randn(1, 16, 32)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 wins every token
        moe(x)
        load, _ = moe.take_stats()
    assert load.tolist() == [0, 0, 0, 0]  # no_grad: not a training step, nothing recorded
    moe.train()
    moe(x.requires_grad_()).sum().backward()
    assert moe.take_stats()[0].tolist() == [0, 0, 0, 16]


def test_head_dim_and_qk_norm_attention():
    spec = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=16, qk_norm=True, vocab=64,
                     experts=4, top_k=2, first_dense_layers=1)
    model = build_model(spec, device="cpu")
    init_weights(model, 0)
    assert model.layers["0"].attention.wq.weight.shape == (64, 32)
    assert model.layers["0"].attention.q_norm.weight.shape == (16,)
    assert not isinstance(model.layers["0"].feed_forward, MoE) and isinstance(model.layers["1"].feed_forward, MoE)
    logits = model(torch.randint(0, 64, (2, 8)))
    assert logits.shape == (2, 8, 64) and torch.isfinite(logits).all()
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()


def test_tiny_moe_builds_small():
    assert sum(p.numel() for p in build_model(PRESETS["tiny-moe"]).parameters()) < 400_000
