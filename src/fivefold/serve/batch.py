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
class AttentionGroup:
    """Requests whose queries are padded to one length for one attention call: all the decodes (one query each)
    together, and each prefill chunk alone, so a decode never pays for a long prompt's padding."""

    rows: torch.Tensor  # [t] the group's tokens in the step's flat order
    token_request: torch.Tensor  # [t] request of each token, within the group
    token_offset: torch.Tensor  # [t] its place in the request's query
    tables: torch.Tensor  # [b, n] each request's KV blocks, padded with block 0 (masked)
    mask: torch.Tensor  # [b, 1, Q, n x block_size] True where query q of request i may see key l
    batch: int
    max_query: int


# Chosen on bench/serve.py's request set (32 requests, tp1, CPU seconds of 3 interleaved rounds each): one decode
# call 3.0-3.4 s, split at 0.5: 2.7-3.1 s, at 0.7: 2.4-2.8 s, at 0.85: 2.4-2.8 s (docs/serving.md).
DECODE_SPLIT_RATIO = 0.7
DECODE_GROUP_MIN = 4


@dataclass
class BatchIndex:
    """Index tensors of one step, shared by every layer of a stage."""

    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache row each new token's K/V is written to
    groups: list[AttentionGroup]
    sample_rows: torch.Tensor  # [S]


def _group(step: StepBatch, members: list[int], starts: list[int], block_size: int,
           device: torch.device) -> AttentionGroup:
    query_lens = [step.query_lens[i] for i in members]
    context_lens = torch.tensor([step.context_lens[i] for i in members], dtype=torch.long)
    batch, max_query = len(members), max(query_lens)
    widest = max(len(step.block_tables[i]) for i in members)
    tables = torch.zeros(batch, widest, dtype=torch.long)
    for row, i in enumerate(members):
        tables[row, :len(step.block_tables[i])] = torch.tensor(step.block_tables[i], dtype=torch.long)
    rows = torch.cat([torch.arange(starts[i], starts[i] + step.query_lens[i]) for i in members])
    token_request = torch.repeat_interleave(torch.arange(batch), torch.tensor(query_lens))
    token_offset = torch.cat([torch.arange(n) for n in query_lens])
    key_positions = torch.arange(widest * block_size)
    valid_key = key_positions[None, :] < context_lens[:, None]
    # A request's queries are its last query_len positions: query q sits at context_len - query_len + q.
    query_positions = (context_lens[:, None] - torch.tensor(query_lens)[:, None] + torch.arange(max_query)[None, :])
    mask = (key_positions[None, None, :] <= query_positions[:, :, None]) & valid_key[:, None, :]
    return AttentionGroup(rows.to(device), token_request.to(device), token_offset.to(device), tables.to(device),
                          mask[:, None].to(device), batch, max_query)


def decode_groups(decodes: list[int], context_lens: list[int], ratio: float = DECODE_SPLIT_RATIO,
                  smallest: int = DECODE_GROUP_MIN) -> list[list[int]]:
    """The decodes split into attention calls by context length, longest first: a group ends where the next
    request's context is at most `ratio` of the group's longest (its padding would be over 1 / ratio of its own
    keys), if the group and the rest both keep `smallest` requests (one more call costs about as much as reading
    that many short contexts). Each group's reads and scores are padded to its own longest context only."""
    order = sorted(decodes, key=lambda i: -context_lens[i])
    groups: list[list[int]] = []
    for place, i in enumerate(order):
        if (not groups or context_lens[i] <= ratio * context_lens[groups[-1][0]] and len(groups[-1]) >= smallest
                and len(order) - place >= smallest):
            groups.append([])
        groups[-1].append(i)
    return groups


def build_index(step: StepBatch, block_size: int, device: torch.device) -> BatchIndex:
    """The paged-attention indices: slot = block_table[position // block_size] * block_size + position % block_size."""
    starts, total = [], 0
    for count in step.query_lens:
        starts.append(total)
        total += count
    positions = torch.tensor(step.positions, dtype=torch.long)
    slot_list = []
    for table, start, count in zip(step.block_tables, step.context_lens, step.query_lens):
        slot_list += [table[p // block_size] * block_size + p % block_size for p in range(start - count, start)]
    decodes = [i for i, n in enumerate(step.query_lens) if n == 1]
    prefills = [[i] for i, n in enumerate(step.query_lens) if n > 1]
    groups = [_group(step, members, starts, block_size, device)
              for members in decode_groups(decodes, step.context_lens) + prefills]
    return BatchIndex(positions.to(device), torch.tensor(slot_list, dtype=torch.long, device=device), groups,
                      torch.tensor(step.sample_rows, dtype=torch.long, device=device))
