"""The eager runtime's counts that the cost model's host costs multiply (cost/stack.py eager_ops, cost/moe.py,
cost/dataparallel.py parameter_tensors), recounted on the runtime's own modules with a TorchDispatchMode:
aten ops per block and per model end, element-wise traffic beyond the fused kernels, parameter tensors."""

import dataclasses

import pytest

from fivefold.cost.dataparallel import parameter_tensors
from fivefold.cost.eager_ops import eager_ops
from fivefold.spec import PRESETS, ModelSpec

VARIANTS = {
    "tiny": PRESETS["tiny"],
    "tiny-gpt": PRESETS["tiny-gpt"],
    "small": PRESETS["small"],
    "llama-mha": dataclasses.replace(PRESETS["tiny"], kv_heads=4),
    "learned-rmsnorm": dataclasses.replace(PRESETS["tiny"], position="learned", kv_heads=4),
    "gpt-tied": dataclasses.replace(PRESETS["tiny-gpt"], tied_embeddings=True),
    # MoE blocks: a routed copy per token reaches each of the 4 experts in the counting probe's 16 tokens.
    "moe": dataclasses.replace(PRESETS["tiny"], experts=4, top_k=2, expert_ffn_hidden=64, shared_experts=1,
                               aux_loss_coef=0.01),
    "moe-gpt": dataclasses.replace(PRESETS["tiny-gpt"], experts=4, top_k=2, expert_ffn_hidden=64,
                                   router_norm_topk=False),
}


def _dispatched_ops(spec: ModelSpec, layers: int, first: bool, last: bool, expert_gemm: str = "auto"
                    ) -> tuple[int, int]:
    """(forward, backward) aten ops of a stage model of the runtime with its loss, counted by torch; `expert_gemm`:
    how its MoE experts run (models/moe.py)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from fivefold.models import build_model, init_weights
    from fivefold.runtime.train import TokenCrossEntropy

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    model = build_model(dataclasses.replace(spec, layers=layers), device="cpu")
    init_weights(model, 0)
    for block in model.modules():
        if hasattr(block, "experts"):
            block.experts.gemm = expert_gemm
    if not first:
        model.tok_embeddings = model.pos_embeddings = None
    if not last:
        model.norm = model.output = None
    tokens = torch.randint(0, spec.vocab, (2, 9))
    inputs = tokens[:, :-1] if first else torch.randn(2, 8, spec.hidden, requires_grad=True)
    out = model(inputs)  # untimed warm-up
    forward, backward = Count(), Count()
    with forward:
        out = model(inputs)
        loss = TokenCrossEntropy(16)(out, tokens[:, 1:]) if last else out.sum()
    with backward:
        loss.backward()
    return forward.ops, backward.ops


@pytest.mark.parametrize("name", list(VARIANTS))
def test_eager_op_counts_match_the_runtime_modules(name):
    spec = VARIANTS[name]
    ops = eager_ops(spec)
    one, two = _dispatched_ops(spec, 1, True, True), _dispatched_ops(spec, 2, True, True)
    assert (two[0] - one[0], two[1] - one[1]) == (ops.layer_forward, ops.layer_backward)
    ends = (ops.stage_forward + ops.embedding_forward + ops.head_forward, ops.embedding_backward + ops.head_backward)
    assert (2 * one[0] - two[0], 2 * one[1] - two[1]) == ends
    # A last stage alone: its position ids, the head and the loss (the input's gradient is no op).
    last = _dispatched_ops(spec, 1, False, True)
    assert (last[0] - ops.layer_forward, last[1] - ops.layer_backward) == (
        ops.stage_forward + ops.head_forward, ops.head_backward)


@pytest.mark.parametrize("name", ["moe", "moe-gpt"])
def test_grouped_experts_dispatch_a_fixed_count_whatever_the_experts(name):
    """torch._grouped_mm experts (cost/moe.py MOE_GROUPED_EXPERT_OPS): the same count for 4 and 8 experts."""
    for experts in (4, 8):
        spec = dataclasses.replace(VARIANTS[name], experts=experts)
        ops = eager_ops(spec, grouped_experts=True)
        one = _dispatched_ops(spec, 1, True, True, "grouped")
        two = _dispatched_ops(spec, 2, True, True, "grouped")
        assert (two[0] - one[0], two[1] - one[1]) == (ops.layer_forward, ops.layer_backward)


def _elementwise_traffic(spec: ModelSpec, layers: int, tokens: int) -> tuple[float, float]:
    """(forward, backward) elements read and written by the element-wise ops of the runtime's model (every
    op but views, matmuls, attention and embedding lookups), counted by torch."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from fivefold.models import build_model, init_weights
    from fivefold.runtime.train import TokenCrossEntropy

    own_terms = ("aten.mm.", "aten.addmm.", "aten.bmm.", "scaled_dot_product", "aten.embedding")

    class Traffic(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            view = any(r.alias_info is not None for r in func._schema.returns) and not str(func).endswith("_")
            if not view and not any(term in str(func) for term in own_terms):
                self.elements += sum(t.numel() for t in tree_flatten((args, kwargs, out))[0]
                                     if isinstance(t, torch.Tensor))
            return out

    model = build_model(dataclasses.replace(spec, layers=layers), device="cpu")
    init_weights(model, 0)
    batch = torch.randint(0, spec.vocab, (tokens // 64, 65))
    forward, backward = Traffic(), Traffic()
    with forward:
        loss = TokenCrossEntropy(tokens)(model(batch[:, :-1]), batch[:, 1:])
    with backward:
        loss.backward()
    return forward.elements, backward.elements


@pytest.mark.parametrize("name", ["tiny", "small", "llama-mha", "tiny-gpt"])
def test_unfused_traffic_is_what_the_runtime_moves_beyond_the_fused_kernels(name):
    """Per token and layer, the runtime's element-wise ops move the fused kernels' elements that cost/layer.py
    charges (Llama: 12h + 3f + 2kv forward, 10h + 5f + 2kv backward; GPT: 10h + 2f, 8h + 3f) plus the
    stack's unfused traffic, within 5%."""
    spec = dataclasses.replace(VARIANTS[name], max_seq_len=64)
    h, f, kv = spec.hidden, spec.ffn_hidden, spec.kv_heads * spec.head_dim
    fused = (12 * h + 3 * f + 2 * kv, 10 * h + 5 * f + 2 * kv) if spec.position == "rope" else (10 * h + 2 * f,
                                                                                                8 * h + 3 * f)
    ops = eager_ops(spec)
    one, two = _elementwise_traffic(spec, 1, 512), _elementwise_traffic(spec, 2, 512)
    per_layer = [(b - a) / 512 for a, b in zip(one, two)]
    assert per_layer[0] == pytest.approx(fused[0] + ops.layer_forward_traffic, rel=0.05)
    assert per_layer[1] == pytest.approx(fused[1] + ops.layer_backward_traffic, rel=0.05)


@pytest.mark.parametrize("name", ["moe", "moe-gpt"])
def test_eager_moe_traffic_is_what_the_runtime_moves_beyond_the_fused_kernels(name):
    """Per token and MoE block, the runtime's element-wise ops move cost/layer.py's fused kernels' elements
    plus eager_ops' unfused traffic (within 5%); per micro-batch, whatever the tokens, the backward stacks
    the experts' weight gradients (layer_backward_fixed)."""
    spec = dataclasses.replace(VARIANTS[name], max_seq_len=64)
    h, f, kv, k, s = spec.hidden, spec.expert_ffn_hidden, spec.kv_heads * spec.head_dim, spec.top_k, \
        spec.shared_experts
    rope = spec.position == "rope"
    activation = (3, 5) if spec.mlp == "swiglu" else (2, 3)
    fused = ((12 * h + 2 * kv) if rope else 10 * h, (10 * h + 2 * kv) if rope else 8 * h)
    fused = tuple(base + 4 * k * h + (k + s) * f * act for base, act in zip(fused, activation))
    layers = {tokens: [b - a for a, b in zip(_elementwise_traffic(spec, 1, tokens),
                                              _elementwise_traffic(spec, 2, tokens))] for tokens in (512, 1024)}
    per_token = [(layers[1024][i] - layers[512][i]) / 512 for i in range(2)]
    fixed = layers[512][1] - 512 * per_token[1]
    ops = eager_ops(spec)
    assert per_token[0] == pytest.approx(fused[0] + ops.layer_forward_traffic, rel=0.05)
    assert per_token[1] == pytest.approx(fused[1] + ops.layer_backward_traffic, rel=0.05)
    assert fixed == pytest.approx(ops.layer_backward_fixed, rel=0.05)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parameter_tensors_match_the_runtime_modules(name):
    from fivefold.models import build_model

    spec = VARIANTS[name]
    model = build_model(spec, device="meta")
    assert parameter_tensors(spec, spec.layers, True, True) == len(list(model.parameters()))
    model.norm = model.output = None
    assert parameter_tensors(spec, spec.layers, True, False) == len(list(model.parameters()))
