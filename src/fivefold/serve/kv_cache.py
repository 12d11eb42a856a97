"""The paged KV cache of one pipeline stage on one tp rank: per layer, K and V rows [blocks x block_size,
kv_heads_local, head_dim]. A token's row is its slot (batch.py); the scheduler's block tables say which blocks a
request owns, so requests of any length share one preallocated pool and nothing is copied when they grow."""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(self, layers: list[int], blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        rows = blocks * block_size
        self.block_size = block_size
        self.keys = {layer: torch.zeros(rows, kv_heads, head_dim, dtype=dtype, device=device) for layer in layers}
        self.values = {layer: torch.zeros(rows, kv_heads, head_dim, dtype=dtype, device=device) for layer in layers}

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[layer][slots] = keys.to(self.keys[layer].dtype)
        self.values[layer][slots] = values.to(self.values[layer].dtype)

    def read(self, layer: int, context_slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, L, kv_heads, head_dim] of each request's context."""
        return self.keys[layer][context_slots].to(dtype), self.values[layer][context_slots].to(dtype)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))
