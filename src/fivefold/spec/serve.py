"""ServeLayout: how one model is served — the Plan-like record that `fivefold serve`, `fivefold generate` and
`plan/estimate/simulate --serve` share. Degrees (tp x pp x replicas, ep for MoE), the compute and KV-cache dtypes,
and the scheduler's limits (BatchLimits). Validated on construction with one-line errors; no torch here.

The KV-cache arithmetic (bytes per token on one device, blocks that fit a memory budget) lives here too, so the
runtime that allocates the cache and the cost model that predicts its capacity compute it the same way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fivefold.errors import SpecError, require
from fivefold.spec.checks import check_count, check_field_types, divisors
from fivefold.spec.model import ModelSpec

SERVE_DTYPES = ("bf16", "fp16", "fp32", "fp8")  # fp8: FP8 weights and GEMMs (H100 and newer)
KV_DTYPES = ("bf16", "fp16", "fp32", "fp8")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
MAX_BLOCK_SIZE = 1024  # tokens per KV block; vLLM uses 16, a few kernels 32-256
GPU_MEMORY_UTILIZATION = 0.9  # fraction of a GPU's memory the server may use (vLLM's default and meaning)


def check_gpu_memory_utilization(fraction: float) -> float:
    """--gpu-memory-utilization: a fraction in (0, 1], or a SpecError naming the flag."""
    require(isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and math.isfinite(fraction)
            and 0 < fraction <= 1, "--gpu-memory-utilization", fraction,
            "must be a fraction of the device's memory in (0, 1], e.g. 0.9")
    return float(fraction)


@dataclass(frozen=True)
class BatchLimits:
    """What the scheduler may put into one step (batching/scheduler.py), per replica."""

    max_batch: int = 256  # requests running at once (continuous batching); vLLM's max_num_seqs
    max_tokens_per_step: int = 2048  # tokens one step computes: 1 per decode plus prefill chunks (chunked prefill)
    kv_blocks: int = 1024  # blocks in each replica's KV cache (a block holds block_size tokens of every layer)
    block_size: int = 16  # tokens per KV block

    def __post_init__(self) -> None:
        check_field_types(self, "serve")
        check_count(self.max_batch, "serve.max_batch", what="requests running at once; flag --max-batch")
        check_count(self.max_tokens_per_step, "serve.max_tokens_per_step",
                    what="tokens one step computes; flag --max-tokens-per-step")
        check_count(self.kv_blocks, "serve.kv_blocks", what="KV-cache blocks; flag --kv-blocks")
        check_count(self.block_size, "serve.block_size", limit=MAX_BLOCK_SIZE, what="tokens per KV block")

    @property
    def kv_tokens(self) -> int:
        """Tokens the cache holds (over all requests of one replica)."""
        return self.kv_blocks * self.block_size


@dataclass(frozen=True)
class ServeLayout:
    """One deployment: `replicas` copies of the model, each split over tp x pp devices."""

    tp: int = 1  # tensor parallel: attention heads and MLP split, one reduction after each
    pp: int = 1  # pipeline parallel: layers split into pp stages, pp batches in flight
    replicas: int = 1  # independent copies behind one router (balanced by queued tokens)
    ep: int = 1  # MoE: experts split over the tp ranks of a stage (1 or tp)
    dtype: str = "bf16"  # weights and GEMMs
    kv_dtype: str = "bf16"  # KV cache
    limits: BatchLimits = BatchLimits()

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "replicas", "ep"):
            check_count(getattr(self, name), f"serve.{name}", what=f"flag --{name}")
        require(isinstance(self.dtype, str) and self.dtype in SERVE_DTYPES, "serve.dtype", self.dtype,
                f"use one of {', '.join(SERVE_DTYPES)} (flag --dtype)")
        require(isinstance(self.kv_dtype, str) and self.kv_dtype in KV_DTYPES, "serve.kv_dtype", self.kv_dtype,
                f"use one of {', '.join(KV_DTYPES)} (flag --kv-dtype)")
        require(isinstance(self.limits, BatchLimits), "serve.limits", self.limits, "must be a BatchLimits")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.replicas

    def check_model(self, model: ModelSpec) -> None:
        """The degrees fit this model: tp splits the query heads (kv heads split or replicated, as vLLM does),
        pp leaves every stage a layer, ep splits the experts over the tp ranks."""
        if model.heads % self.tp:
            raise SpecError("--tp", self.tp, f"must divide the model's {model.heads} attention heads; valid: "
                            f"{', '.join(map(str, divisors(model.heads)))}")
        if model.kv_heads % self.tp and self.tp % model.kv_heads:
            raise SpecError("--tp", self.tp, f"must divide the model's {model.kv_heads} key/value heads or be a "
                            f"multiple of them; valid: {', '.join(map(str, _kv_friendly(model)))}")
        require(self.pp <= model.layers, "--pp", self.pp,
                f"must be at most the model's {model.layers} layers (every stage holds a layer)")
        if self.ep > 1:
            require(model.experts > 0, "--ep", self.ep, f"expert parallel needs an MoE model; {model.name} is dense "
                    "(use --ep 1)")
            require(self.ep == self.tp, "--ep", self.ep,
                    f"must be 1 or equal to --tp={self.tp} (the tp ranks of a stage hold the experts)")
            require(model.experts % self.ep == 0, "--ep", self.ep,
                    f"must divide the model's {model.experts} experts")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _kv_friendly(model: ModelSpec) -> list[int]:
    return [tp for tp in divisors(model.heads) if model.kv_heads % tp == 0 or tp % model.kv_heads == 0]


def kv_heads_per_device(model: ModelSpec, tp: int) -> int:
    """KV heads one tp rank stores: its share, or one replicated head when tp exceeds the kv heads (vLLM)."""
    return max(1, model.kv_heads // tp)


def layers_on_busiest_stage(model: ModelSpec, pp: int) -> int:
    """Layers of the largest pipeline stage (the first stages take the remainder)."""
    return math.ceil(model.layers / pp)


def kv_bytes_per_token(model: ModelSpec, tp: int, pp: int, kv_dtype: str) -> int:
    """Bytes one cached token takes on the busiest device: K and V for its stage's layers and its kv heads."""
    return (2 * layers_on_busiest_stage(model, pp) * kv_heads_per_device(model, tp) * model.head_dim
            * DTYPE_BYTES[kv_dtype])


def kv_blocks_for_memory(memory_bytes: float, model: ModelSpec, tp: int, pp: int, kv_dtype: str,
                         block_size: int) -> int:
    """KV blocks that fit `memory_bytes` on each device (--kv-memory); at least one block or an error."""
    per_block = kv_bytes_per_token(model, tp, pp, kv_dtype) * block_size
    blocks = int(memory_bytes // per_block)
    require(blocks >= 1, "--kv-memory", memory_bytes / 2**30,
            f"holds no KV block of {block_size} tokens ({per_block / 2**20:.2f} MiB per block on one device); "
            "give more memory")
    return blocks


def layout_from_dict(data: object, where: str = "layout") -> ServeLayout:
    """The ServeLayout that ServeLayout.to_dict wrote (a serving run's serve_run.json); SpecError naming the field."""
    shape = "write the table ServeLayout.to_dict writes (tp, pp, replicas, ep, dtype, kv_dtype, limits)"
    require(isinstance(data, dict), where, data, shape)
    assert isinstance(data, dict)
    limits = data.get("limits", {})
    require(isinstance(limits, dict), f"{where}.limits", limits, shape)
    known = {f.name for f in dataclasses.fields(ServeLayout)}
    for table, names, here in ((data, known, where),
                               (limits, {f.name for f in dataclasses.fields(BatchLimits)}, f"{where}.limits")):
        unknown = sorted(set(table) - names)
        require(not unknown, f"{here}.{unknown[0] if unknown else ''}", None,
                f"unknown field; known: {', '.join(sorted(names))}")
    return ServeLayout(**{**data, "limits": BatchLimits(**limits)})
