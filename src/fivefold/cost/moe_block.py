"""The MoE block of one layer, one micro-batch, one rank, term by term (issue 25); cost/layer.py calls it in
place of the dense MLP and `estimate` shows each term in its breakdown (moe_terms).

Per MoE layer on the busiest rank of the ep group (TrainSpec.expert_imbalance: its experts' rows over the
mean; every other rank waits for it at the combine):
- router: the [tokens, hidden] x [hidden, experts] GEMM, then softmax and top-k in fp32 over the
  [tokens, experts] logits (read the logits, write the fp32 probabilities, read them for top-k, write the
  k weights and indices; backward: the softmax gradient over the same fp32 tensor) and, with an auxiliary
  loss, its reductions over the probabilities;
- permute / unpermute: every routed copy of a token is gathered into expert order before dispatch and
  scattered back (weighted) after the combine: read + write of hidden elements per copy, each way;
- host sync: the dispatcher needs the token counts per expert on the host to size the all-to-all (Megatron-
  Core's alltoall dispatcher copies them to the CPU, fivefold's runtime calls .tolist()): the CPU waits for the
  GPU queue to drain, then the GPU waits for the CPU to issue the permutation before the all-to-all
  (HOST_SYNC_SECONDS plus those kernels' issue time); backward reuses the counts;
- all-to-all: the counts exchanged (a small all-to-all of experts x 8 bytes), then dispatch and combine of
  every routed copy forward, and both again backward, on the ep group's slowest link;
- experts: experts / ep local experts as one grouped GEMM each for the up (gate) and down projections, at the
  tile efficiency of the rows each local expert actually gets (cost/kernels.py), and the activation;
- shared experts: a dense MLP of width shared_experts x expert_ffn_hidden on every token.
Kernel launches: an eager MoE block issues the ops counted on fivefold's block (cost/moe.py moe_block_ops:
routing, sorting, gathers, a GEMM pair per local expert, the shared experts); a fine-grained model with many
local experts becomes launch-bound when the stack's seconds per kernel times those ops exceed the GPU time.
"""

from __future__ import annotations

from typing import NamedTuple

from fivefold.cost.comm import GroupLink, all_to_all_time
from fivefold.cost.compute import Device
from fivefold.cost.moe import all_to_all_bytes, moe_block_ops, routed_rows
from fivefold.cost.passwork import PassWork, mlp
from fivefold.cost.stack import SoftwareStack
from fivefold.spec.model import ModelSpec


# A device-to-host copy of a few bytes and the stream synchronisation around it: one CUDA round trip
# (launch-to-completion latencies of small copies and syncs are 5-10 us each on current drivers).
HOST_SYNC_SECONDS = 10e-6
# Kernels the dispatcher issues between the sync and the all-to-all (sort / argsort of the expert ids, the
# row gather, split sizes): the GPU is idle while the CPU issues them.
KERNELS_AFTER_SYNC = 4


class MoETerms(NamedTuple):
    """Seconds of one MoE block for one micro-batch on the busiest rank: forward + backward (no recompute)."""

    router: float  # router GEMM, fp32 softmax / top-k, auxiliary loss
    permute: float  # permute and unpermute of the routed copies
    host_sync: float  # GPU idle after the host sync on token counts
    all_to_all: float  # token counts, dispatch and combine, both directions
    experts: float  # grouped expert GEMMs and their activation
    shared_experts: float


class MoEBlock(NamedTuple):
    terms: MoETerms
    up: tuple[float, float, float]  # the expert GEMMs (forward, dgrad, wgrad), for the TP collectives' overlap
    down: tuple[float, float, float]


def moe_tokens(tokens: int, tp: int, etp: int, sequence_parallel: bool, replicated: bool) -> tuple[int, int]:
    """(tokens one rank routes, ways each expert's width is split) under MoE parallel folding (spec/folding.py):
    with sequence parallelism a rank holds tokens / tp of its tp group's `tokens` and the etp group gathers
    etp of those shards (etp = tp: the whole group's tokens, Megatron's default; etp = 1: its own shard, ep
    spanning tp); without it every rank holds all of them. A stack that runs the whole block on every tp rank
    (`replicated`) routes all the tokens of its tp group through unsplit experts."""
    if replicated:
        return tokens, 1
    own = tokens // tp if sequence_parallel and tp > 1 else tokens
    return (own * etp if sequence_parallel and tp > 1 else own), etp


def dispatch_time(tokens: int, model: ModelSpec, element_bytes: int, imbalance: float, link: GroupLink,
                  per_node: bool) -> float:
    """One dispatch (or combine) of `tokens` x top_k copies over the ep group. `per_node` (DeepEP's normal
    kernels; DeepSeek-V3 report, sec. 3.2.2): a token crosses the network once per destination node, then is
    forwarded over NVLink to its experts there; with experts spread evenly over the group's nodes a token's
    top_k experts fall on n (1 - (1 - 1/n)^k) distinct nodes, (n - 1)/n of them remote."""
    copies = all_to_all_bytes(tokens, model, element_bytes, imbalance)
    if not per_node or link.nodes <= 1:
        return all_to_all_time(copies, link)
    n, k = link.nodes, model.top_k
    remote_nodes = n * (1 - (1 - 1 / n) ** k) * (n - 1) / n
    inside = (link.size - 1) / link.size * copies / link.intra_bandwidth
    outside = copies / k * remote_nodes / link.network_bandwidth
    return (link.size - 1) * link.latency + max(inside, outside)


def _seconds(work: PassWork) -> float:
    return (work.forward + work.backward_input + work.backward_weight + work.host_wait
            + sum(work.forward_comm.values()) + sum(work.backward_comm.values()))


def moe_mlp(work: PassWork, model: ModelSpec, tokens: int, ep: int, imbalance: float, tp_split: int,
            device: Device, stack: SoftwareStack, ep_link: GroupLink) -> MoEBlock:
    """Add one MoE block (router to combine) to `work`; `tp_split` ways tp cuts the experts' width."""
    m, e, h = model, device.element_bytes, model.hidden
    kernels = work.forward_kernels, work.backward_kernels
    marks = [_seconds(work)]

    def mark() -> None:
        marks.append(_seconds(work))

    # Router: logits GEMM, fp32 softmax and top-k (+ auxiliary loss reductions).
    work.gemm(device, tokens, h, m.experts)
    probabilities = tokens * m.experts * 4.0
    aux = 2.0 * probabilities if m.aux_loss_coef > 0 else 0.0
    work.elementwise(device, 2 * probabilities + tokens * e * m.experts + probabilities + tokens * m.top_k * 12 + aux,
                     3 * probabilities + aux, 3, 2)
    mark()
    routed, per_expert = routed_rows(tokens, m, ep, imbalance)
    local_experts = m.experts // ep
    busiest = per_expert * local_experts  # rows the busiest rank's experts compute
    # Permute before dispatch and unpermute after combine (read + write per copy each); with ep > 1 the
    # received rows are also sorted by local expert and back.
    moved = (4 * routed + (4 * busiest if ep > 1 else 0)) * h * e
    work.elementwise(device, moved, moved, 4 if ep > 1 else 2, 4 if ep > 1 else 2)
    mark()
    if stack.moe_dispatch_syncs_host:
        work.host_wait += HOST_SYNC_SECONDS + KERNELS_AFTER_SYNC * stack.host_seconds_per_kernel
    mark()
    if ep_link.size > 1:
        counts = all_to_all_time(m.experts * 8.0, ep_link)
        dispatch = dispatch_time(tokens, m, e, imbalance, ep_link, stack.moe_dispatch_per_node)
        work.collective("ep", counts + 2 * dispatch, 2 * dispatch)
    mark()
    swiglu = m.mlp == "swiglu"
    up, down = mlp(work, device, stack, per_expert, h, m.expert_ffn_hidden // tp_split, swiglu, local_experts)
    mark()
    if m.shared_experts:
        mlp(work, device, stack, tokens, h, m.shared_experts * m.expert_ffn_hidden // tp_split, swiglu)
    mark()
    # Launches: the dense MLP's (up, activation, down; five backward) plus what the eager MoE block adds.
    extra_forward, extra_backward = moe_block_ops(m, local_experts)
    work.forward_kernels = kernels[0] + 3 + extra_forward
    work.backward_kernels = kernels[1] + 5 + extra_backward
    parts = [b - a for a, b in zip(marks, marks[1:])]
    return MoEBlock(MoETerms(*parts), up, down)

