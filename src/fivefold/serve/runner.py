"""One pipeline stage of the model on one tp rank, run over the paged KV cache.

fivefold's own modules (models/transformer.py) hold the weights (sliced by shard.py) and compute the norms, the
projections, the MLP and the MoE block; only attention differs from training: the new tokens' K/V are written to
their cache slots, and each request's queries attend to its whole context gathered from its blocks (vLLM's
PagedAttention, done here with a gather and one masked scaled_dot_product_attention per layer)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.models import build_model
from fivefold.models.moe import MoE
from fivefold.models.transformer import rotate_half, rope_cos_sin
from fivefold.serve.batch import BatchIndex, StepBatch, build_index
from fivefold.serve.kv_cache import PagedKVCache
from fivefold.serve.shard import kv_head_range, shard_state_dict, stage_layers
from fivefold.serve.source import ModelSource
from fivefold.serve.window import LayerStream, SafetensorsLayers
from fivefold.spec.serve import ServeLayout
from fivefold.spec import ModelSpec

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ExpertShare:
    """MoE dispatcher for expert parallel: this rank computes only its experts [first, first + count) for every
    token and returns zeros for the others' copies; the all-reduce after the MLP adds the other ranks' experts."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, list[int], object]:
        counts_list = counts.tolist()
        start = sum(counts_list[:self.first])
        local = counts_list[self.first:self.first + self.count]
        end = start + sum(local)
        return rows[start:end], local, (rows.shape[0], start, end)

    def combine(self, rows: torch.Tensor, state: object) -> torch.Tensor:
        total, start, end = state
        out = rows.new_zeros(total, rows.shape[-1])
        out[start:end] = rows
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Queries [B, Q, H, d] against K and V [B, kv heads, L, d] (the cache's layout), mask [B, 1, Q, L].
    One query each (decodes): a kv head's query heads are folded into its query rows ([B, kv heads, H / kv
    heads, d], the same mask for each), an attention without grouped heads, which torch's CPU kernel runs
    faster than enable_gqa (measured, docs/serving.md). Longer queries (a prefill chunk) use enable_gqa."""
    batch, queries, heads, d = q.shape
    kv_heads = k.shape[1]
    if queries == 1:
        out = F.scaled_dot_product_attention(q.view(batch, kv_heads, heads // kv_heads, d), k, v, attn_mask=mask)
        return out.reshape(batch, 1, heads, d)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
    return out.transpose(1, 2)


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


class StageRunner:
    """Forward of one step on one stage: token ids (first stage) or hidden states in, hidden states or the
    sampled rows' logits (last stage) out."""

    def __init__(self, spec: ModelSpec, state: dict, *, stage: int = 0, pp: int = 1, tp: int = 1, tp_rank: int = 0,
                 ep: int = 1, kv_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", kv_dtype: torch.dtype | None = None,
                 all_reduce: Callable[[torch.Tensor], None] | None = None,
                 layer_reader: SafetensorsLayers | None = None, memory_window: int = 0) -> None:
        self.spec, self.tp, self.block_size = spec, tp, block_size
        self.device, self.dtype = torch.device(device), dtype
        self.layers = stage_layers(spec.layers, pp, stage)
        self.first, self.last = stage == 0, stage == pp - 1
        self.all_reduce = all_reduce
        self.shard = dict(tp=tp, tp_rank=tp_rank, ep=ep)
        model = build_model(spec)  # on meta: the modules, no memory
        for key in list(model.layers.keys()):
            if int(key) not in self.layers:
                del model.layers[key]
        if not self.first:
            model.tok_embeddings = model.pos_embeddings = None
        if not self.last:
            model.norm = model.output = None
        local = shard_state_dict(spec, state, self.layers, self.first, self.last, tp, tp_rank, ep)
        for name, tensor in local.items():
            _assign(model, name, tensor.to(device=self.device, dtype=dtype if tensor.is_floating_point() else None))
        # --memory-window: the layers stay on meta until their turn comes (window.py reads them ahead)
        self.stream = LayerStream(layer_reader.layer, self.layers, memory_window) if memory_window else None
        leftover = [name for name, p in model.named_parameters() if p.is_meta
                    and not (self.stream is not None and name.startswith("layers."))]
        if leftover:
            raise ValueError(f"weights missing for {leftover[:3]}")
        if ep > 1:
            per_rank = spec.experts // ep
            for layer in model.layers.values():
                if isinstance(layer.feed_forward, MoE):
                    layer.feed_forward.dispatcher = ExpertShare(tp_rank * per_rank, per_rank)
        self.model = model.eval()
        kv_start, kv_end = kv_head_range(spec, tp, tp_rank)
        self.cache = PagedKVCache(self.layers, kv_blocks, block_size, kv_end - kv_start, spec.head_dim,
                                  kv_dtype or dtype, self.device)
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # this step's cos/sin (_rope_of_step)

    def _bring(self, layer: int) -> None:
        """This layer's weights from the reader thread (sliced for this rank) into its modules."""
        read, weights = self.stream.take()
        assert read == layer, (read, layer)
        for name, tensor in shard_state_dict(self.spec, weights, [layer], False, False, **self.shard).items():
            _assign(self.model, name, tensor.to(device=self.device, dtype=self.dtype))

    def _drop(self, block: nn.Module) -> None:
        for name, param in list(block.named_parameters()):
            owner, _, attr = name.rpartition(".")
            setattr(block.get_submodule(owner), attr, nn.Parameter(torch.empty(param.shape, device="meta"),
                                                                 requires_grad=False))
        self.stream.release()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()

    def _reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is not None:
            self.all_reduce(tensor)
        return tensor

    def _attention(self, layer_id: int, block: nn.Module, x: torch.Tensor, index: BatchIndex,
                   contexts: list[torch.Tensor]) -> torch.Tensor:
        attention = block.attention
        tokens, d = x.shape[0], attention.head_dim
        q = attention.wq(x).view(tokens, -1, d)
        k = attention.wk(x).view(tokens, -1, d)
        v = attention.wv(x).view(tokens, -1, d)
        if attention.q_norm is not None:
            q, k = attention.q_norm(q), attention.k_norm(k)
        if attention.use_rope:
            cos, sin = self._rope_of_step(index, d, attention.rope_theta, q.dtype)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        self.cache.write(layer_id, index.slots, k, v)
        out = torch.empty_like(q)
        for group, context in zip(index.groups, contexts):
            keys, values = self.cache.read(layer_id, context, group.batch, q.dtype)
            if group.max_query == 1:  # the decodes: one query per request, in row order
                out[group.rows] = _attend(q[group.rows][:, None], keys, values, group.mask)[:, 0]
                continue
            if group.batch == 1:  # a prefill chunk alone (batch.py): its queries are its rows, no padding
                out[group.rows] = _attend(q[group.rows][None], keys, values, group.mask)[0]
                continue
            queries = q.new_zeros(group.batch, group.max_query, q.shape[1], d)
            queries[group.token_request, group.token_offset] = q[group.rows]
            out[group.rows] = _attend(queries, keys, values, group.mask)[group.token_request, group.token_offset]
        return self._reduce(attention.wo(out.reshape(tokens, -1)))

    def _rope_of_step(self, index: BatchIndex, head_dim: int, theta: float,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim] of the step's positions, made once per step for every layer."""
        key = (head_dim, theta, dtype)
        if key not in self._rope:
            cos, sin = rope_cos_sin(index.positions, head_dim, theta, dtype)
            self._rope[key] = (cos[:, None, :], sin[:, None, :])
        return self._rope[key]

    @torch.inference_mode()
    def forward(self, step: StepBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] states for the next stage, or (last stage) fp32 logits [S, vocab] of the sampled rows."""
        index = build_index(step, self.block_size, self.device)
        contexts = [self.cache.context_index(group.tables) for group in index.groups]
        self._rope = {}
        model = self.model
        if self.first:
            h = model.tok_embeddings(torch.tensor(step.token_ids, dtype=torch.long, device=self.device))
            if model.pos_embeddings is not None:
                h = h + model.pos_embeddings(index.positions)
        else:
            h = hidden.to(self.device, self.dtype)
        for key, block in model.layers.items():
            if self.stream is not None:
                self._bring(int(key))
            h = h + self._attention(int(key), block, block.attention_norm(h), index, contexts)
            h = h + self._reduce(block.feed_forward(block.ffn_norm(h)[None])[0])
            if self.stream is not None:
                self._drop(block)
        if not self.last:
            return h
        return model.output(model.norm(h[index.sample_rows])).float()


def build_runner(source: ModelSource, layout: ServeLayout, *, stage: int = 0, tp_rank: int = 0,
                 device: torch.device | str = "cpu", memory_window: int = 0,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> StageRunner:
    """The runner of one worker: every weight read up front, or with --memory-window only the resident ones."""
    reader = SafetensorsLayers(source.path, source.spec) if memory_window else None
    state = reader.resident() if reader is not None else source.load_state_dict()
    return StageRunner(source.spec, state, stage=stage, pp=layout.pp, tp=layout.tp, tp_rank=tp_rank, ep=layout.ep,
                       kv_blocks=layout.limits.kv_blocks, block_size=layout.limits.block_size,
                       dtype=TORCH_DTYPES[layout.dtype], kv_dtype=TORCH_DTYPES[layout.kv_dtype], device=device,
                       all_reduce=all_reduce, layer_reader=reader, memory_window=memory_window)
