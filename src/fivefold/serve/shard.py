"""What one worker keeps of the whole state dict: its pipeline stage's layers, and under tensor parallelism its
slice of every split weight (Megatron's column/row split: q/k/v, w1/w3 by output rows, wo/w2 by input columns, so
one all-reduce after attention and one after the MLP restore the full activations).

MoE layers: with --ep equal to --tp each tp rank keeps a contiguous share of whole experts and computes them for
every token (the tokens are replicated over tp), and the MLP's all-reduce sums the experts' outputs, as vLLM's
expert parallel does; with --ep 1 every expert's own MLP is split over tp like a dense one."""

from __future__ import annotations

import re

import torch

from fivefold.spec import ModelSpec

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_ROWS = ("attention.wq.weight", "attention.wq.bias", "feed_forward.w1.weight", "feed_forward.w1.bias",
         "feed_forward.w3.weight", "feed_forward.shared_experts.w1.weight", "feed_forward.shared_experts.w3.weight")
_COLUMNS = ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.shared_experts.w2.weight")
_KV_ROWS = ("attention.wk.weight", "attention.wk.bias", "attention.wv.weight", "attention.wv.bias")
_ONCE = ("attention.wo.bias", "feed_forward.w2.bias")  # added after the all-reduce's sum: one rank keeps them


def stage_layers(layers: int, pp: int, stage: int) -> list[int]:
    """The layers of pipeline stage `stage`: consecutive, the first stages taking the remainder
    (spec/serve.py layers_on_busiest_stage counts the same)."""
    base, extra = divmod(layers, pp)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def kv_head_range(spec: ModelSpec, tp: int, tp_rank: int) -> tuple[int, int]:
    """The kv heads a tp rank stores: its share, or the one head its query heads read when tp exceeds them."""
    if spec.kv_heads >= tp:
        share = spec.kv_heads // tp
        return tp_rank * share, (tp_rank + 1) * share
    head = tp_rank // (tp // spec.kv_heads)
    return head, head + 1


def _piece(tensor: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return tensor.chunk(tp, dim=dim)[rank].contiguous()


def shard_state_dict(spec: ModelSpec, state: dict, layers: list[int], first: bool, last: bool, tp: int,
                     tp_rank: int, ep: int) -> dict[str, torch.Tensor]:
    """This worker's weights, in fivefold names (layer numbers kept)."""
    kept: dict[str, torch.Tensor] = {}
    owned = set(layers)
    kv_start, kv_end = kv_head_range(spec, tp, tp_rank)
    for name, tensor in state.items():
        match = _LAYER.match(name)
        if match is None:
            if (name.startswith(("tok_embeddings", "pos_embeddings")) and first) or \
                    (name.startswith(("norm", "output")) and last):
                kept[name] = tensor
            continue
        if int(match.group(1)) not in owned:
            continue
        local = match.group(2)
        if tp == 1:
            kept[name] = tensor
        elif local in _ROWS:
            kept[name] = _piece(tensor, 0, tp, tp_rank)
        elif local in _COLUMNS:
            kept[name] = _piece(tensor, 1, tp, tp_rank)
        elif local in _KV_ROWS:
            kept[name] = tensor.view(spec.kv_heads, spec.head_dim, *tensor.shape[1:])[kv_start:kv_end].reshape(
                -1, *tensor.shape[1:]).contiguous()
        elif local in _ONCE:
            kept[name] = tensor if tp_rank == 0 else torch.zeros_like(tensor)
        elif local.startswith("feed_forward.experts."):
            if ep > 1:  # whole experts: a contiguous share of the stack
                kept[name] = _piece(tensor, 0, ep, tp_rank)
            else:  # every expert's MLP split: w1/w3 [E, f, h] by f rows, w2 [E, h, f] by f columns
                kept[name] = _piece(tensor, 1 if not local.endswith("w2") else 2, tp, tp_rank)
        else:  # norms, the router, the expert bias: replicated
            kept[name] = tensor
    return kept
