"""Context parallelism: the sequence of every row is split over the cp ranks, and attention talks.

Sharding (DESIGN.md, determinism): the sequence is cut into 2*cp chunks and cp rank r holds chunks r and
2*cp-1-r, so every rank has the same share of causal attention work (an early chunk sees few keys, its
mirror many). Token ids, targets, positions and document ids are cut with the same index; every other
layer (embeddings, norms, MLP, LM head, loss) is per token and runs on the local tokens unchanged.

Attention, two methods (plan.cp_method):
- allgather (Llama 3): each rank all-gathers K and V of the whole sequence (kv_heads wide, so GQA keeps the
  volume small), attends its own queries, and in backward reduce-scatters the K/V gradients back to their
  owners.
- ulysses (DeepSpeed Ulysses): an all-to-all turns sequence shards into head shards, each rank attends the
  whole sequence for heads/cp of the heads, and a second all-to-all turns the result back; backward is the
  same all-to-alls in reverse. Needs heads and kv_heads per tp rank divisible by cp.

torch 2.13's experimental context_parallel needs CUDA flash kernels and FlexAttention has no CPU backward,
so these are small autograd functions on torch.distributed collectives around F.scaled_dot_product_attention
with an explicit mask built from global positions and document ids: exact on gloo, the same math on NCCL.
Gathered keys come in rank order, not sequence order; the mask, built from the gathered positions, does not
care about order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fivefold.models.attention import attend, visible
from fivefold.models.transformer import Attention
from fivefold.spec import Plan


# --- sharding of a batch ---------------------------------------------------------------------------

def chunk_index(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global sequence indices held by `cp_rank`: chunks r and 2*cp-1-r of 2*cp equal chunks."""
    if cp == 1:
        return torch.arange(seq_len, device=device)
    size = seq_len // (2 * cp)
    first = torch.arange(cp_rank * size, (cp_rank + 1) * size, device=device)
    mirror = 2 * cp - 1 - cp_rank
    return torch.cat([first, torch.arange(mirror * size, (mirror + 1) * size, device=device)])


def document_layout(inputs: torch.Tensor, end_of_document: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, document ids) [batch, seq] of packed input rows: a document ends with (and includes) its
    end-of-document token; positions count from 0 inside each document."""
    ends = (inputs == end_of_document).long()
    documents = torch.cumsum(ends, dim=1) - ends  # the end token belongs to the document it closes
    index = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    # Start of each token's document: the largest index j <= i where a document starts (j = 0 or after an end).
    starts = torch.zeros_like(inputs)
    starts[:, 1:] = ends[:, :-1] * index[:, 1:]
    return index - torch.cummax(starts, dim=1).values, documents


def shard_batch(plan: Plan, cp_rank: int, inputs: torch.Tensor, targets: torch.Tensor,
                end_of_document: int | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """This cp rank's columns of the replica's rows, and the model's keyword inputs: {} for the plain
    causal run (cp 1, no documents), else positions [batch, local seq] and, with documents, document ids.
    Positions are given per row so pipeline schedules can split them into micro-batches like the tokens."""
    if plan.cp == 1 and not plan.train.document_mask:
        return inputs, targets, {}
    batch, seq = inputs.shape
    if plan.train.document_mask:
        if end_of_document is None:
            raise ValueError("--document-mask needs a tokenizer with an end-of-document token")
        positions, documents = document_layout(inputs, end_of_document)
    else:
        positions, documents = torch.arange(seq, device=inputs.device).expand(batch, seq), None
    index = chunk_index(seq, plan.cp, cp_rank, inputs.device)
    extra = {"positions": positions[:, index].contiguous()}
    if documents is not None:
        extra["documents"] = documents[:, index].contiguous()
    return inputs[:, index].contiguous(), targets[:, index].contiguous(), extra


def split_micro_batches(extra: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]] | None:
    """The keyword inputs cut into micro-batches of `size` rows; None when there are none."""
    if not extra:
        return None
    pieces = {name: value.split(size) for name, value in extra.items()}
    return [dict(zip(pieces, parts)) for parts in zip(*pieces.values())]


# --- collectives with autograd ---------------------------------------------------------------------

def _gather_seq(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[batch, s, ...] on each rank -> [batch, size*s, ...], rank-major along the sequence."""
    local = x.transpose(0, 1).contiguous()
    out = local.new_empty((size * local.shape[0], *local.shape[1:]))
    dist.all_gather_single(out, local, group=group)
    return out.transpose(0, 1)


class GatherSequence(torch.autograd.Function):
    """Forward: all-gather along the sequence; backward: reduce-scatter (sum) of the gradient, so each
    rank gets the gradient of its own chunk from every rank's queries."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _gather_seq(x, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full = grad.transpose(0, 1).contiguous()
        out = full.new_empty((full.shape[0] // ctx.size, *full.shape[1:]))
        dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.transpose(0, 1), None, None


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[batch, s, heads, d] -> [batch, size*s, heads/size, d]: send head group j to rank j, receive every
    rank's sequence chunk for this rank's head group."""
    batch, seq, heads, dim = x.shape
    send = x.reshape(batch, seq, size, heads // size, dim).permute(2, 1, 0, 3, 4).contiguous()
    received = torch.empty_like(send)  # [source rank, s, batch, heads/size, d]
    dist.all_to_all_single(received, send, group=group)
    return received.permute(2, 0, 1, 3, 4).reshape(batch, size * seq, heads // size, dim)


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """The inverse: [batch, size*s, heads/size, d] -> [batch, s, heads, d]."""
    batch, full, heads, dim = x.shape
    seq = full // size
    send = x.reshape(batch, size, seq, heads, dim).permute(1, 2, 0, 3, 4).contiguous()
    received = torch.empty_like(send)  # [source rank = head group, s, batch, heads/size, d]
    dist.all_to_all_single(received, send, group=group)
    return received.permute(2, 1, 0, 3, 4).reshape(batch, seq, size * heads, dim)


class UlyssesAllToAll(torch.autograd.Function):
    """Sequence shards to head shards (`to_heads`) or back; each direction's backward is the other one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.size, ctx.to_heads = group, size, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        undo = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return undo(grad.contiguous(), ctx.group, ctx.size), None, None, None


# --- attention -------------------------------------------------------------------------------------

class ContextParallelAttention:
    """Replaces Attention.core: (q, k, v local [batch, s, heads, d], positions, documents of the local
    tokens) -> this rank's attention output [batch, s, heads, d]."""

    def __init__(self, group: dist.ProcessGroup, method: str) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.method = method

    def _gather_layout(self, positions: torch.Tensor, documents: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions and document ids of every cp rank's tokens, in the order the keys are gathered."""
        layout = positions if documents is None else torch.stack([positions, documents], dim=-1)
        with torch.no_grad():
            full = _gather_seq(layout.to(torch.int64), self.group, self.size)
        return (full, None) if documents is None else (full[..., 0], full[..., 1])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 documents: torch.Tensor | None) -> torch.Tensor:
        key_positions, key_documents = self._gather_layout(positions, documents)
        if self.method == "ulysses":
            q, k, v = (UlyssesAllToAll.apply(t, self.group, self.size, True) for t in (q, k, v))
            mask = visible(key_positions, key_positions, key_documents, key_documents)
            return UlyssesAllToAll.apply(attend(q, k, v, mask), self.group, self.size, False)
        # One collective for K and V together: concatenated on the head-dim axis.
        kv = GatherSequence.apply(torch.cat([k, v], dim=-1), self.group, self.size)
        k_all, v_all = kv.split(k.shape[-1], dim=-1)
        mask = visible(positions, key_positions, documents, key_documents)
        return attend(q, k_all, v_all, mask)


def apply_context_parallel(model: nn.Module, cp_group: dist.ProcessGroup, method: str) -> None:
    """Give every attention layer of this (stage) model the cp group's attention."""
    core = ContextParallelAttention(cp_group, method)
    for module in model.modules():
        if isinstance(module, Attention):
            module.core = core


def positions_per_row(plan: Plan) -> bool:
    """Whether the runtime passes positions [batch, seq] to the model (else the model counts 0..seq-1)."""
    return plan.cp > 1 or plan.train.document_mask


def data_parallel_mesh(world: DeviceMesh, plan: Plan) -> DeviceMesh:
    """The mesh gradients are summed (and ZeRO shards) over: dp, or dp x cp flattened, since every cp rank
    holds the gradient of its own tokens only."""
    if plan.cp == 1:
        return world["dp"]
    return world["dp", "cp"]._flatten("dp_cp")
