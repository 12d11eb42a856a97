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
- experts: experts / ep local experts as one grouped GEMM each for the up (gate) and down projections, or a GEMM
  per expert as the stack launches them (expert_gemms), at the tile efficiency of the rows each local expert
  actually gets (cost/kernels.py), and the activation (cost/moe_experts.py). fivefold's own experts run as
  torch._grouped_mm on sm90+ GPUs (grouped_gemm_time, fitted on measured H200 grouped GEMMs) and as its loop
  elsewhere (runs_grouped_mm).
  With a skewed router (TrainSpec.expert_load, the busiest expert over the mean) the rows crowd onto
  experts / load experts (active_experts): fewer, taller GEMMs, and the others' launches run empty;
- shared experts: a dense MLP of width shared_experts x expert_ffn_hidden on every token.
Two dispatcher variants the MoE Parallel Folding paper's runs used: token dropping at a capacity factor
(stack.moe_drops_tokens: the router's capacity mask, the sync before the first permutation) and Megatron-Core
0.8-0.9's sequence-level dispatcher (stack.moe_sequence_dispatch: sequence_dispatch_copies / _exchanges).
Kernel launches: an eager MoE block issues the ops counted on fivefold's block (cost/moe.py moe_block_ops:
routing, sorting, gathers, a GEMM pair per local expert, the shared experts); a fine-grained model with many
local experts becomes launch-bound when the stack's seconds per kernel times those ops exceed the GPU time.
"""

from __future__ import annotations

from typing import NamedTuple

from fivefold.cost.comm import GroupLink, all_gather_time, all_reduce_time, all_to_all_time, reduce_scatter_time
from fivefold.cost.compute import Device
from fivefold.cost.moe import all_to_all_bytes, moe_block_ops, routed_rows
from fivefold.cost.moe_experts import expert_gemms, runs_grouped_mm
from fivefold.cost.passwork import PassWork, mlp
from fivefold.cost.stack import SoftwareStack
from fivefold.spec.model import ModelSpec


# A device-to-host copy of a few bytes and the stream synchronisation around it: one CUDA round trip
# (launch-to-completion latencies of small copies and syncs are 5-10 us each on current drivers).
HOST_SYNC_SECONDS = 10e-6
# Kernels the dispatcher issues between the sync and the all-to-all (sort / argsort of the expert ids, the
# row gather, split sizes): the GPU is idle while the CPU issues them.
KERNELS_AFTER_SYNC = 4
# Token dropping (a capacity factor without padding: Megatron-Core's --moe-expert-capacity-factor, as the MoE
# Parallel Folding paper's benchmarks ran with factor 1, its section 4.2): the output size of the first
# permutation is no longer tokens x top_k, so MoEAlltoAllTokenDispatcher.preprocess moves the host sync before it
# (cuda_sync_point "before_permutation_1", megatron/core/transformer/moe/token_dispatcher.py at core_v0.11.0 and
# d98e8a6) and the permutation's index kernels are issued behind the sync too: moe_utils.permute without fusion
# transposes the routing map, builds the token indices (arange) and masked_selects them (a nonzero pass and the
# index kernel), before the row gather the permute term already charges.
PERMUTE_INDEX_KERNELS = 4
# The capacity mask of topk_softmax_with_capacity (moe_utils.py, drop policy "probs"): a top-k over the tokens of
# each expert (k = capacity), zeros + scatter of the mask, logical_and with the top-k map, the masked probabilities;
# backward the product's gradient. (forward, backward) kernels.
CAPACITY_MASK_KERNELS = (5, 1)


# Transformer Engine's FP8 GroupedLinear allocates the quantized input and its transpose per expert before its one
# multi-cast kernel: 2 x num_gemms torch.empty calls per GEMM input (TransformerEngine issue #1499, a maintainer's
# profile of GroupedLinear's CPU time), host work of the same order as an op issued from Python. Forward: the two
# projections' inputs; backward: the two output gradients. (forward, backward) host ops per local expert.
TE_FP8_HOST_OPS_PER_EXPERT = (4, 4)
# FP8 GroupedLinear needs each expert's rows in multiples of 16: Megatron-Core's TEGroupedMLP pads the dispatched
# rows before the experts and unpads their output (Fp8Padding / Fp8Unpadding, megatron/core/transformer/moe/
# experts.py at Megatron-LM d98e8a6, for the all-to-all dispatcher without router padding), each a copy of the
# rows (TE's fused_multi_row_padding: read and write, transformer_engine/pytorch/module/fp8_padding.py); the
# backward unpads and pads the gradients. Row passes of hidden elements (each a read and a write), each way.
TE_FP8_PADDING_PASSES = 4


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
    expert_rows: int  # rows the busiest rank's local experts compute (after any etp gather)
    up: tuple[float, float, float]  # the expert GEMMs (forward, dgrad, wgrad), for the TP collectives' overlap
    down: tuple[float, float, float]


class MoETokens(NamedTuple):
    """How one rank's MoE block sees its tokens under MoE parallel folding (spec/folding.py)."""

    routed: int  # tokens this rank routes: router, permutes, the ep all-to-all, the shared experts
    gathered: int  # ways the etp group gathers the dispatched copies after the all-to-all (1: none)
    split: int  # ways each routed expert's width is split (etp)
    shared_split: int  # ways the shared experts' width is split


def moe_tokens(tokens: int, tp: int, etp: int, sequence_parallel: bool, splits_over_tp: bool) -> MoETokens:
    """What one rank routes of its tp group's `tokens`, and how its experts are split.

    Megatron-Core with sequence parallelism: a rank routes its own tokens / tp and dispatches them over ep; the
    etp group all-gathers the received copies after the all-to-all (MoEAlltoAllTokenDispatcher: the gather over
    the expert tensor-parallel group follows the dispatch) and the shared experts (SharedExpertMLP, tp-split under
    SP) cost what the rank's own tokens cost at their whole width; without sequence parallelism every tp rank
    routes all of them. `splits_over_tp` (fivefold's runtime, runtime/expert_folding.py): every tp rank routes its
    own tokens / tp with or without sequence parallelism, gathered over etp the same way."""
    if splits_over_tp or (sequence_parallel and tp > 1):
        return MoETokens(tokens // tp, etp, etp, 1)
    return MoETokens(tokens, 1, etp, etp)


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


def routing(work: PassWork, device: Device, model: ModelSpec, tokens: int) -> None:
    """Softmax and top-k in fp32 over the [tokens, experts] logits (read the logits, write the fp32 probabilities,
    read them for top-k, write the k weights and indices; backward: the softmax gradient over the same fp32
    tensor) and, with an auxiliary loss, its reductions over the probabilities."""
    probabilities = tokens * model.experts * 4.0
    aux = 2.0 * probabilities if model.aux_loss_coef > 0 else 0.0
    work.elementwise(device, 2 * probabilities + tokens * device.element_bytes * model.experts + probabilities
                     + tokens * model.top_k * 12 + aux, 3 * probabilities + aux, 3, 2)


def sequence_dispatch_copies(work: PassWork, device: Device, own_bytes: float, gathered_bytes: float) -> None:
    """The copies Megatron-Core's sequence-level all-to-all dispatcher (the MoEAlltoAllTokenDispatcher of
    Megatron-Core 0.8-0.9, kept as `alltoall_seq` in megatron/core/transformer/moe/legacy_a2a_token_dispatcher.py at
    core_v0.11.0) adds to the token-level one, per micro-batch, with tp > 1 and the experts split at the
    attention's tp; each tp rank dispatches the whole sequence on its hidden slice (tensor_parallel/mappings.py):
    - all_to_all_sp2hp before the permute and all_to_all_hp2sp after the unpermute each copy the rank's own
      activation (`own_bytes`: torch.cat of its hidden-dimension splits);
    - the gather of the received rows over tp is along the hidden dimension (_gather_along_last_dim: all-gather,
      then torch.cat of the chunks along the last dimension) and the reduce-scatter before the combine first
      concatenates the last-dimension splits (_reduce_scatter_along_last_dim): a copy of the gathered rows
      (`gathered_bytes`) each, beside the collectives etp_exchange costs.
    Backward runs the reverse functions, the same four copies; each copy reads and writes its tensor."""
    copies = 2 * (2 * own_bytes + 2 * gathered_bytes)
    work.elementwise(device, copies, copies, 4, 4)


def sequence_dispatch_exchanges(work: PassWork, tokens: int, experts: int, hidden: int, element_bytes: int,
                                tp_link: GroupLink) -> None:
    """The tp collectives of the sequence-level dispatcher (sequence_dispatch_copies), per micro-batch: the
    router's [tokens, experts] logits all-gathered over tp (TopKRouter.routing for `alltoall_seq`: every tp rank
    routes the whole sequence, the paper's full-sequence dropping; backward a reduce-scatter), and
    all_to_all_sp2hp / all_to_all_hp2sp, an all-to-all over tp of the rank's own [tokens, hidden] activation
    each, forward and backward."""
    logits = tokens * tp_link.size * experts * element_bytes
    exchange = 2 * all_to_all_time(tokens * hidden * element_bytes, tp_link)
    work.collective("tp", all_gather_time(logits, tp_link) + exchange, reduce_scatter_time(logits, tp_link) + exchange)


def sequence_dispatch_group(stack: SoftwareStack, sequence_parallel: bool, etp: int,
                            tp_link: GroupLink) -> GroupLink | None:
    """The tp group a sequence-level dispatcher exchanges over: Megatron-Core 0.8-0.9 with sequence parallel,
    tp > 1 and the experts split at the attention's tp (it has no expert tp of its own); None otherwise."""
    if stack.moe_sequence_dispatch and sequence_parallel and tp_link.size > 1 and etp == tp_link.size:
        return tp_link
    return None


def _seconds(work: PassWork) -> float:
    return (work.forward + work.backward_input + work.backward_weight + work.host_wait
            + sum(work.forward_comm.values()) + sum(work.backward_comm.values()))


def moe_mlp(work: PassWork, model: ModelSpec, split: MoETokens, ep: int, imbalance: float, device: Device,
            stack: SoftwareStack, ep_link: GroupLink, sequence_tp: GroupLink | None = None,
            load: float = 1.0) -> MoEBlock:
    """Add one MoE block (router to combine) to `work` for the tokens and expert split of `split`.
    `sequence_tp`: the tp group of a sequence-level dispatcher (sequence_dispatch_copies; None: token-level).
    `load`: the busiest expert's tokens over the mean (TrainSpec.expert_load); with ep > 1 the part of it the
    busiest rank's imbalance does not already account for skews that rank's own experts."""
    m, e, h, tokens = model, device.element_bytes, model.hidden, split.routed
    kernels = work.forward_kernels, work.backward_kernels
    marks = [_seconds(work)]

    def mark() -> None:
        marks.append(_seconds(work))

    # Router: logits GEMM, fp32 softmax and top-k (+ auxiliary loss reductions); a sequence-level dispatcher
    # gathers the logits over tp and routes the whole sequence on every tp rank.
    work.gemm(device, tokens, h, m.experts)
    sequence_tp = sequence_tp if sequence_tp is not None and sequence_tp.size > 1 else None
    routing_tokens = tokens * sequence_tp.size if sequence_tp is not None else tokens
    routing(work, device, m, routing_tokens)
    if stack.moe_drops_tokens:  # capacity mask over the fp32 [tokens, experts] gates (CAPACITY_MASK_KERNELS)
        gates = routing_tokens * m.experts
        work.elementwise(device, gates * (4 + 2 + 3 + 9) + routing_tokens * m.top_k * 8, gates * 9,
                         *CAPACITY_MASK_KERNELS)
    mark()
    routed, per_expert = routed_rows(tokens, m, ep, imbalance)
    per_expert *= split.gathered  # the etp group's copies of each local expert's rows
    local_experts = m.experts // ep
    busiest = per_expert * local_experts  # rows the busiest rank's experts compute
    # Permute before dispatch and unpermute after combine (read + write per copy each); with ep > 1 the
    # received (and etp-gathered) rows are also sorted by local expert and back.
    sorts = ep > 1 or split.gathered > 1
    drops = stack.moe_drops_tokens and stack.moe_dispatch_syncs_host
    if drops and device.host is None:  # the sync comes before the first permutation (PERMUTE_INDEX_KERNELS)
        work.host_sync()
    moved = (4 * routed + (4 * busiest if sorts else 0)) * h * e
    work.elementwise(device, moved, moved, 4 if sorts else 2, 4 if sorts else 2)
    if sequence_tp is not None:
        sequence_dispatch_copies(work, device, tokens * h * e, busiest * h * e)
    mark()
    if stack.moe_dispatch_syncs_host:
        if device.host is None and not drops:  # a profiled CPU issues what it computes: its host costs are in
            work.host_sync()  # series (cost/host.py)
        after_sync = KERNELS_AFTER_SYNC + (PERMUTE_INDEX_KERNELS if drops else 0)
        work.host_wait += HOST_SYNC_SECONDS + after_sync * stack.host_seconds_per_kernel
    mark()
    if sequence_tp is not None:
        sequence_dispatch_exchanges(work, tokens, m.experts, h, e, sequence_tp)
    if ep_link.size > 1:
        counts = all_to_all_time(m.experts * 8.0, ep_link)
        dispatch = dispatch_time(tokens, m, e, imbalance, ep_link, stack.moe_dispatch_per_node)
        work.collective("ep", counts + 2 * dispatch, 2 * dispatch)
    mark()
    swiglu = m.mlp == "swiglu"
    within = load / imbalance if ep > 1 else load
    up, down = expert_gemms(work, device, stack, per_expert, h, m.expert_ffn_hidden // split.split, swiglu,
                            local_experts, within)
    if stack.grouped_gemm_streams > 1 and device.fp8_gemm_peak > 0:  # TE's FP8 GroupedLinear: padded rows
        padded = TE_FP8_PADDING_PASSES * busiest * h * e
        work.elementwise(device, padded, padded, 2, 2)
    mark()
    if m.shared_experts:
        mlp(work, device, stack, tokens, h, m.shared_experts * m.expert_ffn_hidden // split.shared_split, swiglu)
    mark()
    # Launches: the dense MLP's (up, activation, down; five backward) plus what the eager MoE block adds.
    extra_forward, extra_backward = moe_block_ops(m, local_experts, runs_grouped_mm(stack, device))
    if stack.grouped_gemm_streams > 1 and device.fp8_gemm_peak > 0:  # TE's multi-stream FP8 GroupedLinear
        extra_forward += TE_FP8_HOST_OPS_PER_EXPERT[0] * local_experts
        extra_backward += TE_FP8_HOST_OPS_PER_EXPERT[1] * local_experts
    work.forward_kernels = kernels[0] + 3 + extra_forward
    work.backward_kernels = kernels[1] + 5 + extra_backward
    parts = [b - a for a, b in zip(marks, marks[1:])]
    return MoEBlock(MoETerms(*parts), busiest, up, down)



def etp_exchange(work: PassWork, model: ModelSpec, block: MoEBlock, etp_link: GroupLink, element_bytes: int) -> None:
    """etp > 1: the etp group exchanges the dispatched copies around the experts, per micro-batch: an all-gather
    of `block.expert_rows` rows forward and a reduce-scatter of the partial outputs, backward the reverse pair
    (uneven rows, costed as the even collectives of the busiest rank's rows)."""
    rows = block.expert_rows * model.hidden * element_bytes
    exchange = all_gather_time(rows, etp_link) + reduce_scatter_time(rows, etp_link)
    if exchange > 0:
        work.collective("tp", exchange, exchange)


def tp_split_block_comm(work: PassWork, model: ModelSpec, block: MoEBlock, hidden_bytes: float,
                        sequence_parallel: bool, tp_link: GroupLink, etp_link: GroupLink, element_bytes: int) -> None:
    """The collectives of an MoE block whose tp ranks each route their own tokens / tp (fivefold's runtime,
    runtime/expert_folding.py), per micro-batch:
    - etp > 1: the etp group exchanges the dispatched copies (etp_exchange);
    - tp > 1 without sequence parallel: the replicated input is cut locally (backward: its gradient all-gathered,
      SplitSequence) and the output all-gathered (GatherSequence; backward keeps a part): one all-gather of the
      block's whole activation (`hidden_bytes`) each way;
    - tp > 1: the router's and shared experts' weights saw different tokens on each tp rank, so their
      gradients are all-reduced over tp in backward, one all-reduce per weight (SumGradient).
    Under sequence parallelism the input already is the rank's part: no activation collective over tp."""
    etp_exchange(work, model, block, etp_link, element_bytes)
    if tp_link.size <= 1:
        return
    gather = 0.0 if sequence_parallel else all_gather_time(hidden_bytes, tp_link)
    weights = [model.experts * model.hidden]  # the router
    if model.shared_experts:
        width = model.shared_experts * model.expert_ffn_hidden
        weights += [model.hidden * width] * (3 if model.mlp == "swiglu" else 2)
    gradients = sum(all_reduce_time(size * element_bytes, tp_link) for size in weights)
    work.collective("tp", gather, gather + gradients)
