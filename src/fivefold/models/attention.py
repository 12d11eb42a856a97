"""The attention kernel call shared by the plain model and context parallel: causal attention, optionally
restricted to each token's own document, with the mask built from positions and document ids.

A query may see a key when both are in the same document and the key's position is not after the query's.
Positions restart at each document under --document-mask, but inside one document they are the global
index minus the document's start, so comparing positions orders tokens exactly as the global index does.
Without documents and without context parallel the mask is the plain causal one (`is_causal`), which keeps
the fused kernels' fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visible(q_positions: torch.Tensor, k_positions: torch.Tensor, q_documents: torch.Tensor | None,
            k_documents: torch.Tensor | None) -> torch.Tensor:
    """Boolean mask [batch, 1, q_len, k_len] (or [q_len, k_len] for 1-D positions): True where the
    query may attend to the key."""
    allowed = q_positions[..., :, None] >= k_positions[..., None, :]
    if q_documents is not None and k_documents is not None:
        allowed = allowed & (q_documents[..., :, None] == k_documents[..., None, :])
    return allowed.unsqueeze(-3) if allowed.dim() == 3 else allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [batch, q_len, heads, head_dim], k/v [batch, k_len, kv_heads, head_dim] -> [batch, q_len, heads,
    head_dim]. `mask` None means causal over equal-length q and k."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
    repeats = q.shape[1] // k.shape[1]
    if repeats > 1:  # GQA: each kv head serves `repeats` consecutive query heads (as HF repeat_kv)
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    documents: torch.Tensor | None) -> torch.Tensor:
    """Attention over the whole sequence held by this rank. Without documents the explicit positions are
    0..seq-1 in order (runtime or default), so the causal flag is the same mask."""
    if documents is None:
        return attend(q, k, v, None)
    return attend(q, k, v, visible(positions, positions, documents, documents))
