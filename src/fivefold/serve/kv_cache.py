"""The paged KV cache of one pipeline stage on one tp rank. Per layer one tensor holds K and V as
[2, kv_heads_local, blocks, block_size, head_dim]: a token's place is its slot (batch.py,
block * block_size + offset), the scheduler's block tables say which blocks a request owns, so requests of any
length share one preallocated pool and nothing is copied when they grow.

Heads before blocks, and K beside V, so that reading a batch's context is one index_select of whole blocks
(block_size x head_dim contiguous values each) that lands as K and V [batch, kv_heads, context, head_dim], the
layout attention reads without another copy (a per-token gather in [rows, heads, dim] order took 1.3-2.7x as
long on a decode step of 32 requests: docs/serving.md, Speed)."""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(self, layers: list[int], blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.blocks, self.block_size, self.kv_heads, self.head_dim = blocks, block_size, kv_heads, head_dim
        self.kv = {layer: torch.zeros(2, kv_heads, blocks * block_size, head_dim, dtype=dtype, device=device)
                   for layer in layers}
        # the row of (K or V, head h, block 0) among the cache's [2 * kv_heads * blocks] block rows
        self._head_rows = torch.arange(2 * kv_heads, device=device).view(2, 1, kv_heads, 1) * blocks

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values [T, kv_heads, head_dim] of the step's new tokens into their slots [T]."""
        cache = self.kv[layer]
        cache[0, :, slots] = keys.transpose(0, 1).to(cache.dtype)
        cache[1, :, slots] = values.transpose(0, 1).to(cache.dtype)

    def context_index(self, tables: torch.Tensor) -> torch.Tensor:
        """The block rows that `read` takes for block tables [B, n] (made once per step, used by every layer)."""
        return (self._head_rows + tables[None, :, None, :]).flatten()

    def read(self, layer: int, index: torch.Tensor, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, kv_heads, n x block_size, head_dim] of the blocks in `index` (context_index)."""
        cache = self.kv[layer]
        rows = cache.view(-1, self.block_size * self.head_dim).index_select(0, index)
        kv = rows.view(2, batch, self.kv_heads, -1, self.head_dim).to(dtype)
        return kv[0], kv[1]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv.values())
