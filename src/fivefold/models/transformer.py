"""The decoder-only transformer: Llama style (RMSNorm, RoPE, GQA, SwiGLU) and GPT style (LayerNorm,
learned positions, GeLU, biases), both from one ModelSpec.

Module names follow TorchTitan (tok_embeddings, layers.N.attention.wq, feed_forward.w1, ...), so that
tensor-parallel plans, FSDP wrapping and checkpoints address the same fully-qualified names. Layers live
in an nn.ModuleDict keyed "0".."L-1": a pipeline stage deletes the keys it does not own and the names of
the layers it keeps do not change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.models.attention import local_attention
from fivefold.models.moe import MoE
from fivefold.spec import ModelSpec


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim: the Hugging Face RoPE convention,
    so HF Llama q/k weights need no permutation."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [seq, head_dim] (or [batch, seq, head_dim]) for the given absolute positions.

    Computed in forward from `positions` (fp32, as HF does) rather than kept as a buffer: nothing to
    lose when the model is built on meta and moved with to_empty, and context parallel simply passes
    the positions of its own slice.
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if positions.dim() == 1:
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    else:  # [batch, seq] positions (context parallel, packed documents)
        freqs = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads; RoPE when `use_rope`; per-head q/k RMSNorm before
    RoPE when `qk_norm` (Qwen3). The head width is spec.head_dim, which may differ from hidden/heads."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        bias = spec.norm == "layernorm"  # GPT style carries biases, Llama style none
        self.head_dim = spec.head_dim
        self.use_rope = spec.position == "rope"
        self.rope_theta = spec.rope_theta
        kv_width = spec.kv_heads * spec.head_dim
        self.wq = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=bias)
        self.wk = nn.Linear(spec.hidden, kv_width, bias=bias)
        self.wv = nn.Linear(spec.hidden, kv_width, bias=bias)
        self.wo = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=bias)
        self.q_norm = nn.RMSNorm(spec.head_dim, eps=spec.norm_eps) if spec.qk_norm else None
        self.k_norm = nn.RMSNorm(spec.head_dim, eps=spec.norm_eps) if spec.qk_norm else None
        # q, k, v [batch, seq, heads, head_dim], positions, documents -> [batch, seq, heads, head_dim];
        # context parallel (runtime/context_parallel.py) swaps in its own that talks to the other cp ranks.
        self.core = local_attention

    def forward(self, x: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor | None = None
                ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Head counts come from the tensors (-1), so a TP-sharded module holding a slice of the heads
        # runs this code unchanged.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype)
            if positions.dim() == 1:  # one table for every row
                cos, sin = cos[None, :, None, :], sin[None, :, None, :]
            else:  # per-row positions (context parallel, packed documents)
                cos, sin = cos[:, :, None, :], sin[:, :, None, :]
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        out = self.core(q, k, v, positions, documents)
        return self.wo(out.reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU w2(silu(w1 x) * w3 x) (Llama) or w2(gelu(w1 x)) with biases (GPT)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.swiglu = spec.mlp == "swiglu"
        bias = not self.swiglu
        self.w1 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=bias)
        self.w2 = nn.Linear(spec.ffn_hidden, spec.hidden, bias=bias)
        self.w3 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=False) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
    return nn.LayerNorm(spec.hidden, eps=spec.norm_eps)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + feed_forward(norm(x)); feed_forward is the MoE
    block in the layers spec.is_moe_layer selects."""

    def __init__(self, spec: ModelSpec, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = make_norm(spec)
        self.attention = Attention(spec)
        self.ffn_norm = make_norm(spec)
        self.feed_forward: nn.Module = MoE(spec) if spec.is_moe_layer(layer) else FeedForward(spec)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions, documents)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """A whole decoder, or one pipeline stage of it (set the parts it does not own to None and delete
    the layer keys it does not own)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(spec.max_seq_len, spec.hidden) if spec.position == "learned" else None)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec, i) for i in range(spec.layers)})
        self.norm: nn.Module | None = make_norm(spec)
        self.output: nn.Linear | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings, make output.weight the very tensor tok_embeddings.weight (whole model only)."""
        if self.spec.tied_embeddings and self.tok_embeddings is not None and self.output is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device, recurse: bool = True) -> "Transformer":
        # nn.Module.to_empty replaces each parameter separately, which unties shared weights; tie again.
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [batch, seq] (first stage) or hidden states [batch, seq, hidden] (later stages) ->
        logits [batch, seq, vocab] (last stage) or hidden states.

        `positions` ([seq] or [batch, seq]) are each token's position for RoPE/learned embeddings and for
        the causal mask (default 0..seq-1); `documents` [batch, seq] (packed documents) keeps attention
        inside each document. Context parallel passes the global positions of this rank's chunks."""
        seq = x.shape[1]
        if positions is None:
            positions = torch.arange(seq, device=x.device)
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(positions)
        else:
            h = x
            if self.pos_embeddings is not None:  # vocabulary parallel: the token embedding came from outside
                h = h + self.pos_embeddings(positions)
        for layer in self.layers.values():
            h = layer(h, positions, documents)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def build_model(spec: ModelSpec, device: str | torch.device = "meta") -> Transformer:
    """The model for `spec` with its parameters on `device` (default meta: nothing is allocated).

    On meta, follow with `model.to_empty(device=...)` and `init_weights(model, seed)`; on a real device
    the weights are PyTorch's defaults until `init_weights` runs.
    """
    with torch.device(device):
        return Transformer(spec)
