"""Mixture-of-experts terms of the cost model, kept apart from the dense block (cost/layer.py calls them).

Per MoE layer, per micro-batch, on one rank of an ep group (MoE parallel folding: the ep group is cut
out of the dp x cp ranks, so each rank routes its own tokens):

- router: a [tokens, hidden] x [hidden, experts] GEMM (fp32 softmax is element-wise and small);
- permute / unpermute of the top_k token copies (read + write each, forward and backward);
- dispatch and combine: two all_to_all_single per pass on the slowest link of the ep group, each rank
  sending its tokens' copies and receiving the copies for its experts;
- experts: experts/ep local experts as one grouped GEMM over the rows they received;
- shared experts: a dense MLP of width shared_experts x expert_ffn_hidden on every token.

Load imbalance (TrainSpec.expert_imbalance, tokens of the busiest rank's experts over the mean; 1 =
balanced, the default): the busiest rank computes and receives that many times the mean rows, and every
other rank waits for it at the combine, so the layer takes the busiest rank's time. Tutel (Hwang et al.
2023) and the Least-Loaded EP paper report max/mean loads of 1.2-2 early in training.

Models that mix dense and MoE layers (first_dense_layers, moe_every) are costed as an average block:
the MoE block's cost for the MoE share of the layers and the dense block's for the rest.
"""

from __future__ import annotations

import dataclasses

from fivefold.spec.model import ModelSpec


def moe_share(model: ModelSpec) -> float:
    """The share of the layers that are MoE layers (0 for a dense model)."""
    return model.moe_layers / model.layers if model.is_moe else 0.0


def split_by_layer_kind(model: ModelSpec) -> tuple[ModelSpec, ModelSpec, float] | None:
    """(all-MoE variant, all-dense variant, MoE share) of a model that mixes both kinds of layers, else None."""
    share = moe_share(model)
    if share in (0.0, 1.0):
        return None
    moe = dataclasses.replace(model, first_dense_layers=0, moe_every=1)
    dense = dataclasses.replace(model, experts=0, top_k=0, shared_experts=0, expert_ffn_hidden=0,
                                first_dense_layers=0, moe_every=1)
    return moe, dense, share


def moe_linear_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs of one MoE block's matrices for one token: top_k routed + shared experts + router."""
    matrices = 3 if model.mlp == "swiglu" else 2
    visited = model.top_k + model.shared_experts
    return float(visited * 2 * matrices * model.hidden * model.expert_ffn_hidden + 2 * model.hidden * model.experts)


def routed_rows(tokens: int, model: ModelSpec, ep: int, imbalance: float) -> tuple[int, int]:
    """(token copies this rank sends, rows each of its local experts computes on the busiest rank). Without
    expert parallelism the one rank computes every copy however the router spreads them."""
    routed = tokens * model.top_k
    per_expert = max(1, round(routed * ep / model.experts * (imbalance if ep > 1 else 1.0)))
    return routed, per_expert


def all_to_all_bytes(tokens: int, model: ModelSpec, element_bytes: int, imbalance: float) -> float:
    """Bytes per rank of one dispatch (or combine): the busiest rank receives imbalance x the mean."""
    return tokens * model.top_k * model.hidden * element_bytes * imbalance


def expert_param_share(model: ModelSpec) -> tuple[float, float]:
    """(dense, expert) parameters of an average layer: routed experts are split over ep, the router and
    shared experts are dense (replicated like attention)."""
    matrices = 3 if model.mlp == "swiglu" else 2
    experts = model.experts * matrices * model.hidden * model.expert_ffn_hidden * moe_share(model)
    average = model.layer_params_total() / model.layers
    return average - experts, experts


# What fivefold's eager MoE block (models/moe.py) dispatches beyond the dense block it replaces, counted with
# a TorchDispatchMode on torch 2.13 (tests/test_cost_eager_counts.py recounts them): routing, sorting,
# gathers and the weighted sum (fixed), each local expert's MLP in the Python loop over experts, and a
# shared-expert MLP; by MLP kind, (forward, backward).
MOE_FIXED_OPS = {"swiglu": (15, 9), "gelu": (19, 13)}
MOE_OPS_PER_EXPERT = {"swiglu": (8, 23), "gelu": (5, 14)}
MOE_SHARED_OPS = {"swiglu": (9, 26), "gelu": (6, 16)}
MOE_AUX_LOSS_OPS = (16, 13)  # the auxiliary balance loss, when its coefficient is not 0 (kept summed on the device)
MOE_UNNORMALISED_OPS = (-2, -8)  # router_norm_topk off: no renormalisation of the top-k weights
# The experts as grouped GEMMs (models/moe.py `_grouped`: the offsets, three or two torch._grouped_mm and the
# activation), whatever the number of local experts, in place of the loop's per-expert ops; counted like the others.
MOE_GROUPED_EXPERT_OPS = {"swiglu": (6, 18), "gelu": (4, 10)}


def moe_block_ops(model: ModelSpec, local_experts: int, grouped: bool = False) -> tuple[int, int]:
    """(forward, backward) ops one eager MoE block dispatches beyond the dense block of the same family; `grouped`:
    its experts run as grouped GEMMs (cost/moe_block.py runs_grouped_mm), not a loop over experts."""
    kind = "swiglu" if model.mlp == "swiglu" else "gelu"
    experts = MOE_GROUPED_EXPERT_OPS[kind] if grouped else tuple(local_experts * n for n in MOE_OPS_PER_EXPERT[kind])
    counts = [MOE_FIXED_OPS[kind], experts,
              tuple(model.shared_experts * n for n in MOE_SHARED_OPS[kind])]
    if model.aux_loss_coef > 0:
        counts.append(MOE_AUX_LOSS_OPS)
    if not model.router_norm_topk:
        counts.append(MOE_UNNORMALISED_OPS)
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def moe_mlp_traffic(model: ModelSpec) -> tuple[float, float]:
    """Elements per token the eager MoE block's element-wise ops move beyond cost/layer.py's fused kernels in
    place of the dense MLP's (forward, backward); fitted on the runtime's block like eager_ops' dense formulas (within 1%): routing and
    the weighted sum (RoPE family: 3h backward; GPT family: 2h / 5h), per routed copy the row gather, the
    concatenation of the experts' outputs and the un-permute (4h forward; 14h backward with SwiGLU's
    products, 2f / 4f), per shared expert 3h + 2f / 6h + 4f."""
    h, f, k, s = model.hidden, model.expert_ffn_hidden, model.top_k, model.shared_experts
    if model.position == "rope":
        forward, backward = k * (4 * h + 2 * f) + s * (3 * h + 2 * f), k * (14 * h + 4 * f) + s * (6 * h + 4 * f)
        return forward, 3 * h + backward
    return 2 * h + 4 * k * h + 3 * s * h, 5 * h + 11 * k * h + 3 * s * h


def expert_gradient_stack(model: ModelSpec, local_experts: int) -> float:
    """Elements the backward of one MoE block moves per micro-batch whatever its tokens: the local experts'
    weight gradients stacked into the [experts, ...] parameter's (the loop's unbind's backward: read and write;
    grouped GEMMs write the stacked gradient themselves)."""
    matrices = 3 if model.mlp == "swiglu" else 2
    return 2.0 * local_experts * matrices * model.hidden * model.expert_ffn_hidden
