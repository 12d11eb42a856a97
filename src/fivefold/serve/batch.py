"""What one step hands a pipeline stage: the tokens, their positions and each request's block table, as plain
lists (pickled to the worker processes), and the index tensors the paged attention reads, made from them once."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepBatch:
    """Request i computes query_lens[i] tokens ending at position context_lens[i] - 1; its K/V live in the
    blocks block_tables[i]. The flat lists hold every token of the step, request after request."""

    number: int
    replica: int
    token_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # flat indices of the tokens whose next-token logits the engine samples from

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


@dataclass
class BatchIndex:
    """Index tensors of one step, shared by every layer of a stage."""

    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache row each new token's K/V is written to
    token_request: torch.Tensor  # [T] request of each token
    token_offset: torch.Tensor  # [T] its place in the request's query
    context_slots: torch.Tensor  # [B, L] cache rows of each request's keys, 0..L-1 (padding reads row 0, masked)
    mask: torch.Tensor  # [B, 1, Q, L] True where query q of request b may see key l
    sample_rows: torch.Tensor  # [S]
    batch: int
    max_query: int


def build_index(step: StepBatch, block_size: int, device: torch.device) -> BatchIndex:
    """The paged-attention indices: slot = block_table[position // block_size] * block_size + position % block_size."""
    batch = len(step.query_lens)
    max_query, max_context = max(step.query_lens), max(step.context_lens)
    widest = max(len(table) for table in step.block_tables)
    tables = torch.zeros(batch, widest, dtype=torch.long)
    for row, table in enumerate(step.block_tables):
        tables[row, :len(table)] = torch.tensor(table, dtype=torch.long)
    query_lens = torch.tensor(step.query_lens, dtype=torch.long)
    context_lens = torch.tensor(step.context_lens, dtype=torch.long)
    positions = torch.tensor(step.positions, dtype=torch.long)
    token_request = torch.repeat_interleave(torch.arange(batch), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    token_offset = torch.arange(len(positions)) - starts[token_request]
    slots = tables[token_request, positions // block_size] * block_size + positions % block_size
    key_positions = torch.arange(max_context)
    key_blocks = tables[:, key_positions // block_size]  # [B, L]
    valid_key = key_positions[None, :] < context_lens[:, None]
    context_slots = torch.where(valid_key, key_blocks * block_size + key_positions % block_size, 0)
    query_positions = torch.zeros(batch, max_query, dtype=torch.long)  # padded queries sit at position 0
    query_positions[token_request, token_offset] = positions
    mask = (key_positions[None, None, :] <= query_positions[:, :, None]) & valid_key[:, None, :]
    return BatchIndex(positions.to(device), slots.to(device), token_request.to(device), token_offset.to(device),
                      context_slots.to(device), mask[:, None].to(device),
                      torch.tensor(step.sample_rows, dtype=torch.long, device=device), batch, max_query)
