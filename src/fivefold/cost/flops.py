"""Floating-point operations of a training step.

Counting convention (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", section 5.1): only matrix multiplications count, a multiply-add is 2 FLOPs, attention
counts the full s x s score matrix (no causal discount), and a backward pass costs twice its forward.
For a GPT layer (MHA, 4h GeLU MLP) this gives their eq. (3):

    with full recompute:   96 B s l h^2 (1 + s/(6h) + V/(16 l h))
    without recompute:     72 B s l h^2 (1 + s/(6h) + V/(12 l h))

`model_flops_per_step` (no recompute) is the numerator of MFU; `hardware_flops_per_step` adds the work
that recompute repeats. Both are plain functions of ModelSpec and TrainSpec, so the runtime can report
measured MFU with exactly the numbers the planner predicts with.
"""

from __future__ import annotations

from fivefold.cost.moe import moe_linear_flops_per_token, moe_share
from fivefold.spec.model import ModelSpec
from fivefold.spec.train import TrainSpec


def narayanan_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int, recompute: bool) -> float:
    """Narayanan et al. 2021 eq. (3) (with `recompute`) or its no-recompute form, for a GPT model."""
    b, s, l, h, v = float(batch), float(seq_len), float(layers), float(hidden), float(vocab)
    if recompute:
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def linear_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs of one layer's weight matrices for one token (QKV, output, MLP, MoE router); the query
    width is heads x head_dim, which differs from hidden in Qwen3 and GPT-OSS."""
    h, q, kv = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim
    attention = 2 * h * (q + 2 * kv) + 2 * q * h
    matrices = 3 if model.mlp == "swiglu" else 2
    share = moe_share(model)  # MoE layers' MLP (cost/moe.py) for their share of the layers, dense for the rest
    mlp = share * moe_linear_flops_per_token(model) + (1 - share) * 2 * matrices * h * model.ffn_hidden
    return float(attention + mlp)


def attended_keys(model: ModelSpec, seq_len: int) -> float:
    """Keys one query attends to, averaged over the layers: s in full-attention layers, min(window, s) in
    sliding-window layers (the model FLOPs convention counts the whole band, as it counts the whole s x s)."""
    sliding = model.sliding_layers
    return (sliding * min(model.sliding_window, seq_len) + (model.layers - sliding) * seq_len) / model.layers


def attention_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs of Q K^T and A V for one token: 2 * 2 * keys * heads * head_dim (keys = s without a
    sliding window), full (non-causal) as in eq. (3)."""
    return 4.0 * attended_keys(model, seq_len) * model.heads * model.head_dim


def head_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs of the LM head (h x V logits) for one token."""
    return 2.0 * model.hidden * model.vocab


def layer_forward_flops(model: ModelSpec, tokens: int, seq_len: int) -> float:
    """Forward FLOPs of one transformer layer over `tokens` tokens of sequences of length `seq_len`."""
    return tokens * (linear_flops_per_token(model) + attention_flops_per_token(model, seq_len))


def model_flops_per_step(model: ModelSpec, train: TrainSpec) -> float:
    """FLOPs of one optimizer step with no recompute: 3 x forward of every layer and the LM head.

    This is the MFU numerator (PaLM, Chowdhery et al. 2022, appendix B uses the same "model FLOPs" idea).
    """
    tokens = train.tokens_per_step
    forward = model.layers * layer_forward_flops(model, tokens, train.seq_len) + tokens * head_flops_per_token(model)
    return 3.0 * forward


def recompute_flops_per_step(model: ModelSpec, train: TrainSpec, recompute: str) -> float:
    """Forward work repeated in backward: every layer for "full", the attention core for "selective"."""
    tokens = train.tokens_per_step
    if recompute == "full":
        return model.layers * layer_forward_flops(model, tokens, train.seq_len)
    if recompute == "selective":
        return model.layers * tokens * attention_flops_per_token(model, train.seq_len)
    return 0.0


def hardware_flops_per_step(model: ModelSpec, train: TrainSpec, recompute: str = "none") -> float:
    """Model FLOPs plus the recomputed forward work (what the GPUs actually execute)."""
    return model_flops_per_step(model, train) + recompute_flops_per_step(model, train, recompute)
