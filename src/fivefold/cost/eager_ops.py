"""The eager runtime's dispatched ops and unfused element-wise traffic per micro-batch (EagerOps), and what a
compiled block dispatches instead: the counts the CPU host-cost model multiplies by the profile's seconds per
op (cost/host.py, cost/layer.py). Counted on torch 2.13's own dispatcher (tests/test_cost_eager_counts.py)."""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.cost.moe import expert_gradient_stack, moe_block_ops, moe_mlp_traffic, moe_share
from fivefold.spec.model import ModelSpec

# What one compiled transformer block dispatches per micro-batch (forward, backward) on CPU under inductor:
# the matmuls and attention as extern kernels, the element-wise ops fused into a few C++ kernels, the
# AOTAutograd function around the graph.
COMPILED_BLOCK_OPS = (14, 26)


@dataclass(frozen=True)
class EagerOps:
    """Aten ops fivefold's eager runtime (fivefold.models, the runtime's loss) dispatches for one
    micro-batch; the host cost of a pass on a CPU is these counts x the profile's seconds per op."""

    layer_forward: float  # one transformer block (an average block for a mixed MoE model)
    layer_backward: float
    embedding_forward: int  # token (and learned position) embedding, first stage
    embedding_backward: int
    head_forward: int  # final norm, LM head and cross-entropy loss, last stage
    head_backward: int
    stage_forward: int  # every stage model: its position ids
    layer_forward_traffic: float  # elements per token one block's unfused forward moves beyond cost/layer.py's
    layer_backward_traffic: float  # fused element-wise kernels (forward, backward)
    layer_backward_fixed: float = 0.0  # elements one block's backward moves per micro-batch with whole experts
    #                                    (MoE: cost/moe.py; etp splits it)


def eager_ops(model: ModelSpec, ep: int = 1, grouped_experts: bool = False) -> EagerOps:
    """The counts for this model's block variant, counted with a TorchDispatchMode on torch 2.13
    (tests/test_cost_eager_counts.py recounts them on the runtime's modules). MoE models: the average
    block over their dense and MoE layers, an MoE block holding experts / ep experts (cost/moe.py).

    The GPT block (LayerNorm, learned positions, GeLU, biases, one kv head per head) dispatches 39 ops
    forward and 93 backward; RoPE adds the cos/sin tables and two rotations (28 / 14); SwiGLU the gate
    (5 / 6); RMSNorm, unfused, more than LayerNorm, and the Llama block drops the attention biases
    (12 / 18); grouped-query attention the repeat_interleave of K and V (8 / 7); `grouped_experts`: the MoE
    experts run as grouped GEMMs, not a GEMM per expert (cost/moe.py MOE_GROUPED_EXPERT_OPS). The head's count
    includes the loss, whose targets (a slice of the batch) are copied when flattened.

    Traffic: the element-wise ops of a block (all but the matmuls and attention) read and write, per
    token, 44h + 9f + 7kv elements forward and 82h + 9f + 2kv backward in the Llama block (h hidden, f
    MLP width, kv the K/V width; fitted over 7 shapes, within 3%): unfused RMSNorm (pow, mean, rsqrt,
    two products), RoPE's rotations, SwiGLU's product, GQA's repeated K/V, autograd's gradient sums. The
    fused kernels of cost/layer.py charge 12h + 3f + 2kv and 10h + 5f + 2kv of it. The GPT block
    (LayerNorm and GeLU are single ops) moves 10h + 2f and 23h + 4f: the fused forward, and a backward
    15h + f heavier. Other mixtures take the formula of their position encoding's family."""
    rope, swiglu = model.position == "rope", model.mlp == "swiglu"
    rms, grouped = model.norm == "rmsnorm", model.kv_heads < model.heads
    learned = model.position == "learned"
    h, f, kv = model.hidden, model.ffn_hidden, model.kv_heads * model.head_dim
    # Traffic beyond the MLP's, then the dense MLP's (which an MoE block replaces).
    forward_traffic, backward_traffic = (32.0 * h + 5 * kv, 72.0 * h) if rope else (0.0, 15.0 * h)
    mlp_traffic = (6 * f, 4 * f) if rope else (0, f)
    forward = 39.0 + 28 * rope + 5 * swiglu + 12 * rms + 8 * grouped
    backward = 93.0 + 14 * rope + 6 * swiglu + 18 * rms + 7 * grouped
    fixed = 0.0
    share = moe_share(model)
    if share > 0:
        local = model.experts // ep
        extra_forward, extra_backward = moe_block_ops(model, local, grouped_experts)
        moe_forward, moe_backward = moe_mlp_traffic(model)
        forward, backward = forward + share * extra_forward, backward + share * extra_backward
        forward_traffic += share * moe_forward
        backward_traffic += share * moe_backward
        fixed = 0.0 if grouped_experts else share * expert_gradient_stack(model, local)
    forward_traffic += (1 - share) * mlp_traffic[0]
    backward_traffic += (1 - share) * mlp_traffic[1]
    return EagerOps(
        layer_forward=forward, layer_backward=backward,
        embedding_forward=1 + 2 * learned, embedding_backward=1 + 4 * learned,
        head_forward=13 + 6 * rms, head_backward=19 + 15 * rms, stage_forward=1,
        layer_forward_traffic=forward_traffic, layer_backward_traffic=backward_traffic, layer_backward_fixed=fixed)
