"""Memory of one rank: model states (ZeRO), activations (Korthikanti), and what the schedule keeps in flight.

Model states follow ZeRO (Rajbhandari et al. 2020): with Adam and 16-bit mixed precision each parameter
costs 2 bytes of weights, 2 of gradients and 12 of optimizer state (fp32 master copy, momentum,
variance); stage 1 shards the optimizer state over the N data-parallel ranks, stage 2 also the
gradients, stage 3 also the weights: 16, 4 + 12/N, 2 + 14/N, 16/N bytes per parameter. fp32 training
keeps no master copy: 4 + 4 + 8.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"), which for a GPT layer stores s*b*h*(34 + 5*a*s/h) bytes, and with tensor parallelism t
s*b*h*(10 + 24/t + 5*a*s/(h*t)). We rebuild that sum tensor by tensor so it also covers GQA (smaller K, V),
SwiGLU (three MLP tensors), MoE (top_k token copies), models without dropout (no masks), context
parallelism (s/cp tokens per rank) and fused attention (no s x s score tensors). For a GPT layer with
materialized scores it reduces exactly to their formulas (tests check this). A set head_dim (query width
heads x head_dim != hidden, Qwen3 / GPT-OSS) sizes Q, K, V and the attention output. Sliding-window layers
store what full-attention layers store: fused attention keeps no score tensor either way (only the per-row
log-sum-exp), and the unfused path masks a full s x s score tensor, so the window changes time, not memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.cost.context import context_parallel_kept_bytes
from fivefold.cost.layer import LayerShape
from fivefold.cost.moe import split_by_layer_kind
from fivefold.spec.units import GIB


def zero_model_state_bytes(num_params: float, dtype: str, zero: int, shard: int,
                           grads_sharded: bool = True, unsharded_grad_bytes: float = 0) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes of `num_params` parameters on one rank.

    `grads_sharded=False`: ZeRO-2/3 gradients still accumulate whole, because the software reduces them
    only once per step (torch.distributed.pipelining turns gradient sync off until the last backward);
    `unsharded_grad_bytes` then gives their bytes per element (FSDP2 accumulates them in its reduce dtype).

    A stack that gives `unsharded_grad_bytes` is FSDP2: at ZeRO-3 its sharded parameter is the fp32 master
    weight itself (MixedPrecisionPolicy casts only the gathered copy to bf16; TorchTitan builds the model in
    fp32), so a shard holds 4 bytes of weights and 8 of Adam state, and its reduced gradient shard is in the
    reduce dtype: 4 + 4 + 8 = 16 / N as ZeRO counts, but with whole gradients (pp) 12 / N + those."""
    if dtype == "fp32":
        weights, grads, optimizer = 4.0, 4.0, 8.0
    else:
        weights, grads, optimizer = 2.0, 2.0, 12.0
        if zero >= 3 and unsharded_grad_bytes:
            weights, grads, optimizer = 4.0, float(unsharded_grad_bytes), 8.0
    if zero >= 1:
        optimizer /= shard
    if zero >= 2 and grads_sharded:
        grads /= shard
    elif unsharded_grad_bytes:
        # Whole gradients accumulated in the reduce dtype: FSDP2 without sync (ZeRO-2/3 under pp), and at
        # ZeRO-0/1, whose whole gradients FSDP2 / replicate keep in the fp32 of the master weights.
        grads = unsharded_grad_bytes
    if zero >= 3:
        weights /= shard
    return num_params * weights, num_params * grads, num_params * optimizer


def korthikanti_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                                 sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Korthikanti et al. 2022, activation bytes of one GPT layer (their Table 2), verbatim."""
    s, b, h, a, t = float(seq_len), float(micro_batch), float(hidden), float(heads), float(tp)
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + scores)
    return s * b * h * (10 + 24 / t + scores / t)


def routed_copies(shape: LayerShape) -> float:
    """Rows per token a layer's MLP keeps on the busiest rank: 1 dense; MoE top_k copies, times the busiest ep
    rank's load over the mean (TrainSpec.expert_imbalance) when ep > 1: its experts received that many."""
    m = shape.model
    if not m.is_moe:
        return 1.0
    return m.top_k * (shape.expert_imbalance if shape.ep > 1 else 1.0)


def moe_dispatched_bytes(shape: LayerShape, element_bytes: int) -> float:
    """Of one layer's stored activations, the dispatched token copies an MoE block keeps on the busiest rank
    for one micro-batch: without recompute the rows its experts received and all their expert hidden tensors;
    with selective recompute the expert input matmuls' outputs; none under full recompute (layer input only)."""
    m = shape.model
    if not m.is_moe or shape.recompute == "full":
        return 0.0
    tokens = shape.micro_batch * shape.seq_len // shape.cp
    width = m.expert_ffn_hidden / shape.tp
    inputs = 2 if m.mlp == "swiglu" else 1
    kept = inputs * width if shape.recompute == "selective" else m.hidden + (inputs + 1) * width
    return element_bytes * tokens * routed_copies(shape) * kept


def every_matmul_selective_bytes(shape: LayerShape, element_bytes: int) -> float:
    """Selective recompute that keeps every matmul, attention and TP collective output (fivefold's policy,
    runtime/parallelize.py _SAVE_OPS) plus the block input: Q, K, V, the attention output and its fp32
    log-sum-exp, the row-parallel outputs of wo and w2 (whole partial sums before their reduction), the MLP's
    input matmuls, and with tp > 1 the collectives' outputs (sequence parallel: the all-gathered inputs of
    attention and MLP and the reduce-scattered outputs; else the all-reduced outputs)."""
    m, e, t = shape.model, element_bytes, shape.tp
    tokens = shape.micro_batch * shape.seq_len // shape.cp
    h, q, kv = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    copies = routed_copies(shape)
    width = m.expert_ffn_hidden if m.is_moe else m.ffn_hidden
    mlp_inputs = 2 if m.mlp == "swiglu" else 1
    block_input = h / t if shape.sequence_parallel else h
    kept = block_input + (q + 2 * kv) / t + q / t + 2 * h + copies * mlp_inputs * width / t
    if t > 1:
        kept += 2 * h + 2 * h / t if shape.sequence_parallel else 2 * h
    return e * tokens * kept + tokens * m.heads / t * 4


def layer_activation_bytes(shape: LayerShape, dropout: bool, attention: str, element_bytes: int,
                           selective_ops: bool = False, every_matmul: bool = False, cp_repeats_kv: bool = False,
                           cp_regathers: bool = False) -> float:
    """Bytes one layer keeps from forward to backward for one micro-batch on one rank. `selective_ops`:
    selective recompute at op level (TorchTitan): the layer input, every other matmul output and the
    attention output (with its log-sum-exp) are kept, everything else is recomputed. `cp_repeats_kv`: the
    gathered K/V are heads wide; `cp_regathers`: the CP backward gathers them again, so none are kept
    (cost/context.py)."""
    m, e, t = shape.model, element_bytes, shape.tp
    tokens = shape.micro_batch * shape.seq_len // shape.cp
    h = m.hidden
    replicated_share = 1.0 / t if shape.sequence_parallel else 1.0
    if shape.recompute == "full":
        return e * tokens * h * replicated_share  # the layer input only
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    mask = 1 if dropout else 0
    copies = routed_copies(shape) + m.shared_experts  # each token visits top_k (+ shared) experts
    # Outside the TP regions: two norm inputs, QKV input, MLP input (per expert copy), two dropout masks.
    replicated = tokens * h * (3 * e + e * copies + 2 * mask)
    # Inside: Q, K, V; attention output (projection input); MLP hidden tensors.
    width = m.expert_ffn_hidden if m.is_moe else m.ffn_hidden
    mlp_tensors = 3 if m.mlp == "swiglu" else 2
    if every_matmul and shape.recompute == "selective":
        return every_matmul_selective_bytes(shape, e)
    if selective_ops and shape.recompute == "selective":
        # QKV, output projection, the MLP's input matmuls (one per SwiGLU branch) and its output matmul.
        matmul_outputs = (q + 2 * kv) / t + h + copies * (mlp_tensors - 1) * width / t + h
        return e * tokens * (h * replicated_share + matmul_outputs / 2 + q / t) + tokens * m.heads / t * 4
    sharded = tokens * (e * (q + 2 * kv) + e * q + copies * e * mlp_tensors * width)
    if m.is_moe:
        replicated += tokens * m.experts * 4  # fp32 router probabilities
    if attention == "unfused" and shape.recompute != "selective":
        # Softmax output, dropout mask and dropout output of the b x heads x s x s scores.
        sharded += shape.micro_batch * m.heads * (shape.seq_len // shape.cp) * shape.seq_len * (e + mask * (1 + e))
    elif attention == "flash":
        sharded += tokens * m.heads * 4  # fp32 log-sum-exp per query row
    kept = 0.0 if cp_regathers else context_parallel_kept_bytes(m, shape.seq_len, shape.micro_batch, shape.cp,
                                                                 shape.cp_method, e, cp_repeats_kv)
    return replicated * replicated_share + (sharded + kept) / t


def layer_transient_bytes(shape: LayerShape, dropout: bool, attention: str, element_bytes: int,
                          cp_repeats_kv: bool = False, cp_regathers: bool = False) -> float:
    """Extra memory while one layer runs backward: under full recompute its activations come back (with the
    gathered K/V); a CP backward that gathers K/V again holds them whatever the recompute."""
    if shape.recompute != "full":
        if not cp_regathers:
            return 0.0
        return context_parallel_kept_bytes(shape.model, shape.seq_len, shape.micro_batch, shape.cp, shape.cp_method,
                                           element_bytes, cp_repeats_kv) / shape.tp
    from dataclasses import replace

    return layer_activation_bytes(replace(shape, recompute="none"), dropout, attention, element_bytes,
                                  cp_repeats_kv=cp_repeats_kv)


def in_flight_chunks(schedule: str, pp: int, virtual_stages: int, micro_batches: int, pp_rank: int) -> float:
    """Micro-batches whose activations one pipeline rank holds at its peak, in units of one model chunk.

    gpipe: all m. 1f1b: p - r on rank r. zb-h1: a micro-batch's activations live until its W pass, which
    rank r runs r steps late, so every rank holds p (rank 0 as under 1F1B: Qi et al. 2024's "same peak").
    Interleaved (Megatron's warmup count + 1): 2 (p - r - 1) + (v - 1) p + 1 chunks, i.e.
    (1 + (p-1)/(p v)) of 1F1B on rank 0 (Narayanan et al. 2021). zbv (Qi et al. 2024, "Pipeline Parallelism
    with Controllable Memory"): the V shape holds p micro-batches on every rank, 2p half-size chunks, once
    it is full; with fewer micro-batches rank r holds all m of its first chunk and min(m, r + 1) of its
    second (torch's order, replayed by the simulator).
    """
    m, p, v = micro_batches, pp, virtual_stages
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m * v)
    if schedule == "interleaved-1f1b":
        return float(min(m * v, 2 * (p - pp_rank - 1) + (v - 1) * p + 1))
    if schedule == "zbv":
        return float(min(2 * p, m + min(m, pp_rank + 1)))
    if schedule == "zb-h1":
        return float(min(m, p))
    return float(min(m, p - pp_rank))


@dataclass(frozen=True)
class RankMemory:
    """Peak bytes of one pipeline rank, by kind."""

    params: float  # weights (after ZeRO-3 sharding)
    grads: float  # gradients (after ZeRO-2 sharding)
    optimizer: float  # optimizer state (after ZeRO-1 sharding)
    activations: float  # in-flight micro-batches' stored activations
    transient: float  # working memory: recomputed layer, logits, gathered ZeRO-3 weights
    reserved: float  # CUDA context, workspaces
    moe_dispatched: float = 0.0  # of `activations`, the dispatched MoE token copies (not added again)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient + self.reserved

    def to_dict(self) -> dict:
        return {"peak": self.total / GIB, "params": self.params / GIB, "grads": self.grads / GIB,
                "optimizer": self.optimizer / GIB, "activations": self.activations / GIB,
                "transient": self.transient / GIB, "reserved": self.reserved / GIB,
                **({"moe_dispatched": self.moe_dispatched / GIB} if self.moe_dispatched else {})}
