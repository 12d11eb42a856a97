"""Context parallelism in the cost model: the communication of each method, what of it hides behind
attention, and the memory it adds. No torch here.

Work. Both methods leave each cp rank 1/cp of the causal attention work: allgather because rank r holds
chunks r and 2*cp-1-r of 2*cp (its queries see s/cp * s/2 keys in total, whatever r is), ulysses because
each rank attends the whole sequence for heads/cp of the heads. So layer.py times attention as s/cp query
rows against s keys with the causal half, and every per-token part of the layer (GEMMs, norms, MLP) on s/cp
tokens: the balanced share. (Without the mirror chunk, the last rank would do (2*cp-1)/cp of the average
and set the pace.)

Communication per layer and micro-batch, on the cp group's link (cost/comm.py's GroupLink, which is the
slowest link among the group's ranks: NVLink inside a node, the NIC as soon as the group spans nodes):
- allgather (Llama 3, TorchTitan): forward all-gathers K and V of the whole sequence, 2*b*s*kv_heads*d/tp
  elements (GQA keeps this small: kv_heads, not heads); backward reduce-scatters their gradients, the same
  volume. A rank can attend its own chunk while the rest arrives, so 1/cp of the attention hides the
  gather; the reduce-scatter likewise overlaps 1/cp of the attention backward.
- ulysses (DeepSpeed Ulysses): four all-to-alls forward (Q, K, V to head shards, the output back) and four
  backward (their gradients), each rank sending its b*s/cp tokens' slice; nothing to overlap, since
  attention needs every head shard first. Its volume per rank does not grow with cp; allgather's does.

torch's experimental CP (torch/distributed/tensor/experimental/_attention.py of late 2024, which TorchTitan
ran; the stack's `cp_ring_backward`) does the all-gather form forward (rotate method "allgather": one
all-gather issued before the local causal step, waited before the second), but keeps no gathered K/V: the
backward all-gathers them again (under the first step's attention backward) and passes the dK/dV
accumulators around the ring in fp32 (its convert_to_f32 option, on by default), one send to the next rank
per ring step, cp in all (permute_tensor); each hides under the next step's attention backward (1/cp of it),
the last one under nothing. A model that repeats K/V to every query head before attention (TorchTitan's
Llama calls repeat_kv before F.scaled_dot_product_attention; the stack's `cp_repeats_kv`) moves K/V
heads wide, not kv_heads wide.

Memory: allgather keeps the gathered K and V (the other ranks' (cp-1)/cp share) for the attention backward,
per layer; ulysses keeps head-sharded Q, K, V, the same size as the local ones it replaces.
"""

from __future__ import annotations

from fivefold.cost.comm import GroupLink, all_gather_time, all_to_all_time, p2p_time, reduce_scatter_time


def context_parallel_comm(model, seq_len: int, micro_batch: int, tp: int, method: str, link: GroupLink,
                          element_bytes: int, attention_forward: float, attention_backward: float,
                          repeated_kv: bool = False, ring_backward: bool = False) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of one layer's CP communication for one micro-batch.
    `repeated_kv`: K/V are repeated to every query head before attention; `ring_backward`: torch's
    experimental CP backward (a second all-gather, then dK/dV passed around the ring in fp32)."""
    cp = link.size
    if cp <= 1:
        return 0.0, 0.0
    kv_width = (model.heads if repeated_kv else model.kv_heads) * model.head_dim // tp
    if method == "ulysses":
        local_tokens = micro_batch * seq_len // cp
        q_bytes = local_tokens * model.heads * model.head_dim // tp * element_bytes
        kv_bytes = local_tokens * kv_width * element_bytes
        seconds = 2 * all_to_all_time(q_bytes, link) + 2 * all_to_all_time(kv_bytes, link)  # q, out; k, v
        return seconds, seconds
    full_kv = 2 * micro_batch * seq_len * kv_width * element_bytes
    gather = all_gather_time(full_kv, link)
    if ring_backward:
        step_backward = attention_backward / cp  # one ring step's attention backward
        hop = p2p_time(2 * micro_batch * seq_len // cp * kv_width * 4, link)  # the fp32 dK, dV of one chunk
        backward = max(0.0, gather - step_backward) + (cp - 1) * max(0.0, hop - step_backward) + hop
        return max(0.0, gather - attention_forward / cp), backward
    scatter = reduce_scatter_time(full_kv, link)
    return max(0.0, gather - attention_forward / cp), max(0.0, scatter - attention_backward / cp)


def context_parallel_kept_bytes(model, seq_len: int, micro_batch: int, cp: int, method: str,
                                element_bytes: int, repeated_kv: bool = False) -> float:
    """Bytes of the other ranks' K/V one layer gathers, before the TP split (one micro-batch, one rank): kept
    for backward, or (torch's CP, which gathers again in backward) held while attention runs."""
    if cp <= 1 or method == "ulysses":
        return 0.0
    others = micro_batch * (seq_len - seq_len // cp)
    return 2 * others * (model.heads if repeated_kv else model.kv_heads) * model.head_dim * element_bytes

