"""Time of one transformer layer (and of the embedding and LM head) for one micro-batch on one rank.

Each layer is written out as the kernels Megatron-style tensor parallelism runs (Shoeybi et al. 2019,
Korthikanti et al. 2022 for sequence parallelism): norm, QKV GEMM, attention core, output GEMM, TP
collective, residual, norm, MLP GEMMs, TP collective, residual. Each kernel is timed by cost/compute.py,
each collective by cost/comm.py. Backward splits into the input-gradient part B (dgrad GEMMs, attention
backward, element-wise backward, its TP collectives) and the weight-gradient part W (wgrad GEMMs), as the
zero-bubble schedules need (Qi et al. 2024).

A pass is the slower of the GPU work and the CPU time to issue its kernels (small models on fast GPUs
are launch-bound). TP, CP and EP collectives are not overlapped with compute (Megatron's default), except
context parallelism's K/V all-gather, which partly hides behind the attention of the local chunk
(cost/context.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.cost.comm import SELF, GroupLink, all_gather_time, all_reduce_time, reduce_scatter_time
from fivefold.cost.context import context_parallel_comm
from fivefold.cost.compute import Device, elementwise_time, flash_attention_time, gemm_time
from fivefold.cost.moe import split_by_layer_kind
from fivefold.cost.moe_block import (etp_exchange, moe_mlp, moe_tokens, sequence_dispatch_group,
                                     tp_split_block_comm)
from fivefold.cost.moe_experts import runs_grouped_mm
from fivefold.cost.passwork import ZERO_PASS, PassCost, PassWork, fp8_linear, mlp

__all__ = ["ZERO_PASS", "LayerShape", "PassCost", "embedding_cost", "head_cost", "layer_cost", "padded_vocab"]
from fivefold.cost.eager_ops import eager_ops
from fivefold.cost.stack import SoftwareStack
from fivefold.spec.model import ModelSpec


@dataclass(frozen=True)
class LayerShape:
    """Everything that sets the per-layer cost on one rank (the planner caches on this key)."""

    model: ModelSpec
    seq_len: int  # full sequence length s
    micro_batch: int  # sequences per micro-batch b
    tp: int
    cp: int
    ep: int
    sequence_parallel: bool
    recompute: str
    expert_imbalance: float = 1.0  # busiest rank's expert rows / the mean (TrainSpec.expert_imbalance)
    cp_method: str = "allgather"  # allgather | ulysses (cost/context.py)
    etp: int = 1  # expert tensor parallel (MoE parallel folding: cost/moe_block.py moe_tokens)
    expert_load: float = 1.0  # busiest expert's rows / the mean over experts (TrainSpec.expert_load)


def _tp_collectives(work: PassWork, num_bytes: float, link: GroupLink, sequence_parallel: bool,
                    stack: SoftwareStack, gemms: list[tuple[float, float, float]]) -> None:
    """The TP collectives of one region (attention or MLP): all-reduce, or all-gather + reduce-scatter
    with SP, forward; the same backward. `gemms` are the region's (forward, dgrad, wgrad) GEMM times,
    input GEMM first.

    Overlap, when the stack does it: the input-gradient collective runs while the input GEMM computes its
    weight gradient (Megatron's async TP all-reduce); with `overlap_tp_comm` every collective is cut into
    chunks pipelined with the region's GEMMs (Transformer Engine userbuffers, PyTorch async TP), leaving
    one ring step exposed. Both pipeline through peer memory over NVLink (userbuffers map the TP ranks'
    buffers with CUDA IPC; async TP uses SymmetricMemory), so they only exist for a TP group inside one
    node: a group that spans nodes runs plain NCCL collectives.
    """
    if link.size <= 1:
        return
    # With SP each direction all-gathers the region's input and reduce-scatters its output (the backward
    # swaps them); both are costed apart because they are not equal everywhere (on gloo a reduce-scatter
    # of the same tensor takes 1.5-3x an all-gather's time).
    seconds = (all_gather_time(num_bytes, link) + reduce_scatter_time(num_bytes, link) if sequence_parallel
               else all_reduce_time(num_bytes, link))
    if stack.overlap_tp_comm and link.nodes == 1:
        forward_cover = sum(g[0] for g in gemms)
        backward_cover = sum(g[1] + g[2] for g in gemms)
        floor = seconds / link.size
        work.collective("tp", max(floor, seconds - forward_cover), max(floor, seconds - backward_cover))
    else:
        backward_cover = gemms[0][2] if stack.overlap_tp_backward else 0.0
        work.collective("tp", seconds, max(0.0, seconds - backward_cover))


def layer_cost(shape: LayerShape, device: Device, stack: SoftwareStack, tp_link: GroupLink,
               cp_link: GroupLink, ep_link: GroupLink, etp_link: GroupLink = SELF) -> PassCost:
    """One transformer block, one micro-batch, one rank; the average block of a model mixing dense and MoE
    layers (cost/moe.py)."""
    mixed = split_by_layer_kind(shape.model)
    if mixed is not None:
        moe, dense, share = mixed
        costs = [layer_cost(dataclasses.replace(shape, model=model), device, stack, tp_link, cp_link, ep_link,
                            etp_link) for model in (moe, dense)]
        return costs[0].scaled(share) + costs[1].scaled(1 - share)
    m, e, t = shape.model, device.element_bytes, shape.tp
    b, s_local = shape.micro_batch, shape.seq_len // shape.cp
    tokens = b * s_local  # tokens of this rank
    h, d = m.hidden, m.head_dim
    q, kv = m.heads * d, m.kv_heads * d  # query and key/value widths (q differs from h with a set head_dim)
    heads = m.heads // t
    norm_tokens = tokens // t if shape.sequence_parallel else tokens  # SP shards the non-TP regions
    dropout = stack.uses_dropout(m)
    bias = m.norm == "layernorm"  # GPT blocks carry biases, Llama blocks do not
    hidden_bytes = tokens * h * e  # one activation of the residual stream (unsharded)
    work = PassWork()

    # Attention block: norm, QKV, (rope), core, output projection, TP collective, residual.
    work.elementwise(device, 2 * norm_tokens * h * e, 3 * norm_tokens * h * e, 1, 2)
    qkv = fp8_linear(work, device, stack, tokens, h, (q + 2 * kv) // t, bias=bias)
    if m.position == "rope":
        rope_bytes = 2 * tokens * (q + kv) // t * e
        work.elementwise(device, rope_bytes, rope_bytes, 2, 2)
    attention_start = work.forward
    if stack.attention == "flash":
        before, before_back = work.forward, work.backward_input
        # Sliding-window layers are a share of the blocks: this average block carries that share of them.
        sliding = m.sliding_layers / m.layers
        for share, window in ((1.0 - sliding, 0), (sliding, m.sliding_window)):
            if share > 0:
                work.forward += share * flash_attention_time(device, b * heads, s_local, shape.seq_len, d, True,
                                                             False, window, stack.sdpa_flash2)
                work.backward_input += share * flash_attention_time(device, b * heads, s_local, shape.seq_len, d,
                                                                    True, True, window, stack.sdpa_flash2)
        work.forward_kernels += 1
        work.backward_kernels += 2
        # Selective recompute adds nothing here: FlashAttention's backward recomputes the scores itself.
        if cp_link.size > 1:  # K/V all-gather or Ulysses all-to-alls, partly under attention (cost/context.py)
            work.collective("cp", *context_parallel_comm(m, shape.seq_len, b, t, shape.cp_method, cp_link, e,
                                                         work.forward - before, work.backward_input - before_back,
                                                         stack.cp_repeats_kv, stack.cp_ring_backward))
    else:
        # Materialized scores (Megatron-LM before FlashAttention): Q K^T, fused scale-mask-softmax,
        # dropout, P V, each writing or reading the b * heads * s * s score tensor.
        scores = b * heads * s_local * shape.seq_len
        start = work.forward
        work.forward += gemm_time(device, s_local, shape.seq_len, d, b * heads)
        work.forward += gemm_time(device, s_local, d, shape.seq_len, b * heads)
        score_bytes = 2 * e + ((2 * e + 1) if dropout else 0)  # softmax read+write, dropout r+w+mask
        work.forward += elementwise_time(device, scores * score_bytes, 2 if dropout else 1)
        work.forward += elementwise_time(device, 2 * tokens * q // t * e)  # context permute to [s, b, h]
        work.selective += work.forward - start
        # Backward: dP, dV, dQ, dK GEMMs; dropout and softmax backward over the scores.
        work.backward_input += 2 * gemm_time(device, s_local, shape.seq_len, d, b * heads)
        work.backward_input += 2 * gemm_time(device, s_local, d, shape.seq_len, b * heads)
        backward_score_bytes = 3 * e + ((2 * e + 1) if dropout else 0)
        work.backward_input += elementwise_time(device, scores * backward_score_bytes + 2 * tokens * q // t * e, 3)
        work.forward_kernels += 6
        work.backward_kernels += 8
    attention_forward_total = work.forward - attention_start
    projection = fp8_linear(work, device, stack, tokens, q // t, h, bias=bias)
    _tp_collectives(work, hidden_bytes, tp_link, shape.sequence_parallel, stack, [qkv, projection])
    residual = 3 * e + (1 if dropout else 0)
    work.elementwise(device, norm_tokens * h * residual, norm_tokens * h * (2 * e + 1 if dropout else e),
                     2 if dropout else 1, 1)

    # MLP block: norm, (router, dispatch), up/gate GEMM, activation, down GEMM, (combine), TP, residual.
    work.elementwise(device, 2 * norm_tokens * h * e, 3 * norm_tokens * h * e, 1, 2)
    if m.is_moe:  # router to combine, term by term, over the folded expert groups (cost/moe_block.py)
        split = moe_tokens(tokens, t, shape.etp, shape.sequence_parallel, stack.moe_splits_tokens_over_tp)
        block = moe_mlp(work, m, split, shape.ep, shape.expert_imbalance, device, stack, ep_link,
                        sequence_dispatch_group(stack, shape.sequence_parallel, shape.etp, tp_link), shape.expert_load)
        if stack.moe_splits_tokens_over_tp:
            tp_split_block_comm(work, m, block, hidden_bytes, shape.sequence_parallel, tp_link, etp_link, e)
        elif shape.sequence_parallel and t > 1:  # Megatron-Core: the etp group gathers the received copies
            etp_exchange(work, m, block, etp_link, e)
        else:  # every tp rank routes all tokens: the etp group reduces the experts' partial sums (none at etp 1)
            _tp_collectives(work, split.routed * h * e, etp_link, shape.sequence_parallel, stack,
                            [block.up, block.down])
    else:
        up, down = mlp(work, device, stack, tokens, h, m.ffn_hidden // t, m.mlp == "swiglu", bias=bias)
        _tp_collectives(work, hidden_bytes, tp_link, shape.sequence_parallel, stack, [up, down])
    work.elementwise(device, norm_tokens * h * residual, norm_tokens * h * (2 * e + 1 if dropout else e),
                     2 if dropout else 1, 1)
    if not stack.fused_elementwise and device.host is None:
        # Eager PyTorch: unfused RMSNorm, RoPE, SwiGLU and autograd's sums move this much more (eager_ops).
        ops = eager_ops(m, shape.ep, runs_grouped_mm(stack, device))
        per_token = tokens / t * e
        work.elementwise(device, ops.layer_forward_traffic * per_token,
                         ops.layer_backward_traffic * per_token + ops.layer_backward_fixed / t * e, 0, 0)
    if stack.selective_saves_ops:
        # Op-level selective recompute redoes every op but the attention core and every other matmul.
        work.selective = work.forward - work.linear_forward / 2 - attention_forward_total
    return work.finish(stack, shape.recompute)


def embedding_cost(shape: LayerShape, device: Device, stack: SoftwareStack, tp_link: GroupLink) -> PassCost:
    """Token (and learned position) embedding on the first stage; vocab-parallel over TP."""
    m, e = shape.model, device.element_bytes
    tokens = shape.micro_batch * shape.seq_len // shape.cp
    work = PassWork()
    row_bytes = tokens * m.hidden * e
    extra = 3 * row_bytes if m.position == "learned" else 0
    # ~12 kernels forward per micro-batch: batch copy to the GPU, position ids, vocab-range masking of
    # the ids for the vocab-parallel lookup, lookup, position add, dropout; ~6 backward (sorted scatter-add).
    work.elementwise(device, 2 * row_bytes + extra, 2 * row_bytes + tokens * m.hidden * 4, 12, 6)
    if tp_link.size > 1:  # SP: reduce-scatter to sequence shards, and the backward all-gathers the gradient
        if shape.sequence_parallel:
            work.collective("tp", reduce_scatter_time(row_bytes, tp_link), all_gather_time(row_bytes, tp_link))
        else:
            work.collective("tp", all_reduce_time(row_bytes, tp_link), 0.0)
    return work.finish(stack, "none")


def padded_vocab(vocab: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x tp so every TP shard is GEMM-friendly."""
    multiple = 128 * tp
    return -(-vocab // multiple) * multiple


def head_cost(shape: LayerShape, device: Device, stack: SoftwareStack, tp_link: GroupLink,
              vocab_split: int = 1) -> PassCost:
    """Final norm, LM head GEMM and cross-entropy on the last stage: vocab-parallel, or on the logits
    gathered whole (stack.tp_gathers_logits). `vocab_split`: the rows are further cut over that many pp
    ranks (vocabulary parallelism, cost/vocab.py), each running its slice of the GEMM and the loss."""
    m, e, t = shape.model, device.element_bytes, shape.tp
    tokens = shape.micro_batch * shape.seq_len // shape.cp
    norm_tokens = tokens // t if shape.sequence_parallel else tokens
    vocab = padded_vocab(m.vocab, t * vocab_split) // (t * vocab_split)
    work = PassWork()
    work.elementwise(device, 2 * norm_tokens * m.hidden * e, 3 * norm_tokens * m.hidden * e, 1, 2)
    pp_only = vocab_split > 1 and t > 1 and not stack.vocab_parallel_over_tp
    if pp_only:
        # fivefold's runtime (runtime/vocab_parallel.py): each tp rank runs the whole vocab/pp slice on its own
        # tokens (its sequence shard under sequence parallel, else all of them, as every tp rank does): no
        # gather of the normed sequence or of the logits, the loss statistics reduced over pp only (cost/vocab.py)
        tokens, vocab = norm_tokens, -(-m.vocab // vocab_split)
    elif tp_link.size > 1 and shape.sequence_parallel:
        # the norm's sequence shards gathered forward, their gradient reduce-scattered backward
        work.collective("tp", all_gather_time(tokens * m.hidden * e, tp_link),
                        reduce_scatter_time(tokens * m.hidden * e, tp_link))
    work.gemm(device, tokens, m.hidden, vocab)
    # Cross-entropy in fp32: upcast, max, exp-sum, log-softmax (forward); softmax minus one-hot (backward).
    # Vocab-parallel cross-entropy is a chain of small kernels (max, shift, target masking and gather,
    # exp, sum, log, loss masking and averaging): ~18 forward, ~8 backward.
    forward_bytes, backward_bytes = e + 4 + 4, 4 + e  # one fused pass each way
    if stack.unfused_cross_entropy:
        # Megatron's _VocabParallelCrossEntropy (tensor_parallel/cross_entropy.py, 2021-2024; its fused
        # kernel is opt-in): logits.float() (read e, write 4), max (read 4), in-place shift (8), in-place
        # exp (8), sum (4), in-place division into the softmax kept for backward (8); backward multiplies
        # the softmax by the loss gradient in place (8) and casts it back to the logits' dtype (4 + e).
        forward_bytes, backward_bytes = e + 36, 12 + e
    if pp_only:
        work.elementwise(device, tokens * vocab * forward_bytes, tokens * vocab * backward_bytes, 18, 8)
        return work.finish(stack, "none")
    gathered = tp_link.size > 1 and stack.tp_gathers_logits
    if gathered:  # every TP rank gets the whole logits and runs the loss on all of them (its backward: a slice)
        work.collective("tp", all_gather_time(tokens * m.vocab / vocab_split * e, tp_link), 0.0)
    loss_vocab = m.vocab / vocab_split if gathered else vocab
    work.elementwise(device, tokens * loss_vocab * forward_bytes, tokens * loss_vocab * backward_bytes, 18, 8)
    if tp_link.size > 1 and not gathered:
        work.collective("tp", 3 * all_reduce_time(tokens * 4, tp_link), 0.0)  # max, sum, target logit
    if tp_link.size > 1 and not shape.sequence_parallel:
        work.collective("tp", 0.0, all_reduce_time(tokens * m.hidden * e, tp_link))
    return work.finish(stack, "none")
