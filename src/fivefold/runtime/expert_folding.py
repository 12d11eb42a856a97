"""The collectives of MoE Parallel Folding (spec/folding.py has the rank arithmetic): how tokens reach the
expert slices when ep spans tp x cp x dp ranks and etp splits each expert.

Per MoE block and micro-batch on one rank (Megatron-Core's all-to-all token dispatcher, written over
torch.distributed because torch has none; each step is an autograd function whose backward is the
reverse exchange):

1. tokens: every rank of a stage routes DISJOINT tokens. Under tensor parallel with sequence parallel the
   block's input is already this tp rank's part of the sequence; without it the replicated input is cut
   to this rank's part (SplitSequence) and the output gathered back (GatherSequence), so no tp rank
   repeats another's expert work. The router's and shared experts' gradients then differ over tp and are
   summed over it (SumGradient); the auxiliary loss sums its token counts over the ranks sharing a
   sequence (tp, and cp) first.
2. ep: all_to_all_single over the ep group sends each copy to the rank holding its expert (AllToAllDispatch).
3. etp: the etp ranks of that expert all-gather the rows (uneven sizes, so an all-to-all of copies),
   each computes its column slice of w1/w3 and row slice of w2, and the partial outputs are
   reduce-scattered back to the rows' owners (ExpertTensorParallel).
Expert gradients are summed over edp (FSDP2/replicate with divide factor 1; runtime/expert_parallel.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty(sum(out_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _by_expert(counts_by_source: torch.Tensor) -> torch.Tensor:
    """Rows arrive ordered by source rank, then local expert; the permutation that orders them by expert."""
    sources, local = counts_by_source.shape
    expert_of_row = torch.arange(local, device=counts_by_source.device).repeat(sources).repeat_interleave(
        counts_by_source.flatten())
    return expert_of_row.argsort(stable=True)


def _in_order(rows: int, device: torch.device) -> torch.Tensor:
    """The dry run's stand-in for a permutation (same sizes, no values needed)."""
    return torch.arange(rows, device=device)


class AllToAllDispatch:
    """Send each token copy to the ep rank that owns its expert; bring the results back."""

    def __init__(self, group: dist.ProcessGroup, ep: int, experts: int, ep_index: int) -> None:
        self.group, self.ep, self.local, self.ep_index = group, ep, experts // ep, ep_index

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor | list[int]) -> tuple[torch.Tensor, list[int], object]:
        # rows are sorted by expert, so the rows for ep rank r are one contiguous block.
        if isinstance(counts, list):  # balanced (dry run): every source sends this rank its experts' share
            in_splits = [sum(counts[r * self.local:(r + 1) * self.local]) for r in range(self.ep)]
            mine = counts[self.ep_index * self.local:(self.ep_index + 1) * self.local]
            out_splits = [sum(mine)] * self.ep
            received = AllToAll.apply(rows, out_splits, in_splits, self.group)
            order = _in_order(received.shape[0], rows.device)
            return received[order], [n * self.ep for n in mine], (order, in_splits, out_splits)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # [source rank, local expert]
        by_source = received_counts.view(self.ep, self.local)
        in_splits = counts.view(self.ep, self.local).sum(1).tolist()
        out_splits = by_source.sum(1).tolist()
        received = AllToAll.apply(rows, out_splits, in_splits, self.group)
        order = _by_expert(by_source)
        return received[order], by_source.sum(0).tolist(), (order, in_splits, out_splits)

    def combine(self, rows: torch.Tensor, state: object) -> torch.Tensor:
        order, in_splits, out_splits = state
        return AllToAll.apply(rows[order.argsort()], in_splits, out_splits, self.group)


class ExpertTensorParallel:
    """The etp ranks of one expert slice: all-gather the rows each received (grouped by local expert), and
    reduce-scatter the partial outputs of their column/row slices back to the rows' owners."""

    def __init__(self, group: dist.ProcessGroup, etp: int) -> None:
        self.group, self.etp = group, etp

    def gather(self, rows: torch.Tensor, counts: list[int], balanced: bool = False
               ) -> tuple[torch.Tensor, list[int], object]:
        if balanced:  # dry run: every etp rank received the same balanced counts
            sizes = [rows.shape[0]] * self.etp
            gathered = AllToAll.apply(rows.repeat(self.etp, 1), sizes, sizes, self.group)
            order = _in_order(gathered.shape[0], rows.device)
            return gathered[order], [n * self.etp for n in counts], (order, sizes, rows.shape[0])
        mine = torch.tensor(counts, dtype=torch.int64, device=rows.device)
        every = mine.new_empty(self.etp * len(counts))
        dist.all_gather_single(every, mine, group=self.group)
        every = every.view(self.etp, len(counts))
        sizes = every.sum(1).tolist()
        gathered = AllToAll.apply(rows.repeat(self.etp, 1), sizes, [rows.shape[0]] * self.etp, self.group)
        order = _by_expert(every)
        return gathered[order], every.sum(0).tolist(), (order, sizes, rows.shape[0])

    def reduce_scatter(self, partial: torch.Tensor, state: object) -> torch.Tensor:
        order, sizes, mine = state
        back = AllToAll.apply(partial[order.argsort()], [mine] * self.etp, sizes, self.group)
        return back.view(self.etp, mine, *partial.shape[1:]).sum(0)


class FoldedDispatch:
    """ep all-to-all (when ep > 1), then the etp all-gather (when etp > 1); combine undoes both."""

    def __init__(self, ep: AllToAllDispatch | None, etp: ExpertTensorParallel | None) -> None:
        self.ep, self.etp = ep, etp

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor | list[int]
                 ) -> tuple[torch.Tensor, list[int], object]:
        ep_state = etp_state = None
        balanced = isinstance(counts, list)  # the dry run's balanced split (models/moe.py balanced_counts)
        local_counts = counts if isinstance(counts, list) else counts.tolist()
        if self.ep is not None:
            rows, local_counts, ep_state = self.ep.dispatch(rows, counts)
        if self.etp is not None:
            rows, local_counts, etp_state = self.etp.gather(rows, local_counts, balanced)
        return rows, local_counts, (ep_state, etp_state)

    def combine(self, rows: torch.Tensor, state: object) -> torch.Tensor:
        ep_state, etp_state = state
        if self.etp is not None:
            rows = self.etp.reduce_scatter(rows, etp_state)
        if self.ep is not None:
            rows = self.ep.combine(rows, ep_state)
        return rows


class SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (a weight used on disjoint tokens)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _gather_sequence(x: torch.Tensor, group, parts: int) -> torch.Tensor:
    pieces = x.new_empty(parts * x.shape[0], *x.shape[1:])
    dist.all_gather_single(pieces, x.contiguous(), group=group)
    return torch.cat(pieces.chunk(parts), dim=1)


class SplitSequence(torch.autograd.Function):
    """This tp rank's part of a replicated [batch, seq, hidden]; backward all-gathers the parts' gradients
    (each rank's gradient covers only its part; the input's gradient is the whole, the same on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, parts: int, index: int) -> torch.Tensor:
        ctx.group, ctx.parts = group, parts
        return x.chunk(parts, dim=1)[index].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_sequence(grad, ctx.group, ctx.parts), None, None, None


class GatherSequence(torch.autograd.Function):
    """All-gather the tp ranks' parts along the sequence; backward keeps this rank's part of the (replicated)
    gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, parts: int, index: int) -> torch.Tensor:
        ctx.parts, ctx.index = parts, index
        return _gather_sequence(x, group, parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.parts, dim=1)[ctx.index].contiguous(), None, None, None


class SplitTokens:
    """The MoE block's tokens under tp (and cp): which part of the input this rank routes, and the groups
    that put the sequence back together (models/moe.py LocalTokens is the single-rank version).

    `tp_group`/`tp`/`tp_index`: the tensor-parallel ranks; `split_input` when the input is replicated over
    them (no sequence parallel). `sequence_group`/`parts`: every rank holding a part of the same sequences
    (tp x cp), over which the auxiliary loss's token counts are summed."""

    def __init__(self, tp_group, tp: int, tp_index: int, split_input: bool, sequence_group, parts: int) -> None:
        self.tp_group, self.tp, self.tp_index, self.split_input = tp_group, tp, tp_index, split_input
        self.sequence_group, self.parts = sequence_group, parts

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        if not self.split_input:
            return x
        return SplitSequence.apply(x, self.tp_group, self.tp, self.tp_index)

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        if not self.split_input:
            return out
        return GatherSequence.apply(out, self.tp_group, self.tp, self.tp_index)

    def sum_over_sequence(self, per_sequence: torch.Tensor) -> torch.Tensor:
        if self.parts == 1:
            return per_sequence
        summed = per_sequence.detach().clone()
        dist.all_reduce(summed, group=self.sequence_group)
        return summed

    def synced(self, weight: torch.Tensor) -> torch.Tensor:
        """A replicated weight used on this tp rank's tokens only: its gradient summed over tp."""
        return SumGradient.apply(weight, self.tp_group) if self.tp > 1 else weight
