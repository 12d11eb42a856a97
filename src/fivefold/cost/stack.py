"""SoftwareStack: what the training software does that a Plan does not say.

The same plan runs at different speeds under different software: fused attention or not, gradient
reduction overlapped with backward or not, how much CPU time each kernel launch costs. These are
properties of the framework version, never of one measurement, so they live here as named presets.
`data_parallel_sync(stack, zero, pp)` turns a stack and a plan's ZeRO level into the concrete
collective schedule that both the estimate (cost/dataparallel.py) and the simulator (sim/) follow.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.errors import SpecError
from fivefold.spec.model import ModelSpec

GIB = 2**30


@dataclass(frozen=True)
class SoftwareStack:
    """Framework behaviour; the defaults describe current Megatron-Core / TorchTitan practice."""

    name: str = "modern"  # label for reports
    attention: str = "flash"  # "flash": fused kernel, no s x s scores kept; "unfused": scores materialized
    dropout: bool | None = None  # dropout after attention/residual branches; None: GPT-style (learned) yes
    overlap_grad_reduce: bool = True  # data-parallel gradient reduction runs in buckets during backward
    overlap_param_gather: bool = True  # ZeRO parameter all-gathers are prefetched under compute
    async_p2p: bool = True  # pipeline sends overlap compute in steady state (only fill/drain pay them)
    host_seconds_per_kernel: float = 8e-6  # CPU time to issue one kernel (Python, dispatcher, launch)
    host_serialization: float = 0.0  # share of min(CPU, GPU) time of a pass that does not overlap
    overlap_tp_backward: bool = True  # TP all-reduce of input gradients overlaps the weight-gradient GEMM
    overlap_tp_comm: bool = False  # every TP collective pipelined with its GEMMs (TE userbuffers, async TP)
    grad_reduce_bytes: int = 0  # bytes per gradient element on the wire; 0: 2 for fp16, 4 otherwise
    reserved_bytes: float = 1.0 * GIB  # CUDA context, cuBLAS and NCCL workspaces, allocator slack
    pipeline_defers_grad_sync: bool = False  # pp > 1: gradients reduced once, after a stage's last backward,
    #                                          while the rank waits; shards stay gathered after backward
    zero2_reshards_after_backward: bool = False  # ZeRO-2 frees gathered weights after every backward

    def uses_dropout(self, model: ModelSpec) -> bool:
        # GPT recipes (Megatron, GPT-2/3) train with dropout 0.1; Llama-style recipes use none.
        return self.dropout if self.dropout is not None else model.position == "learned"

    def gradient_bytes(self, dtype: str) -> int:
        # Megatron reduces fp16 gradients in fp16 and accumulates/reduces bf16 ones in fp32.
        if self.grad_reduce_bytes:
            return self.grad_reduce_bytes
        return 2 if dtype == "fp16" else 4


STACKS: dict[str, SoftwareStack] = {
    "modern": SoftwareStack(),
    # Megatron-Core with Transformer Engine as NVIDIA benchmarks it: TP communication overlapped with
    # GEMMs, distributed optimizer with overlapped gradient reduce and parameter gather.
    "megatron-core": SoftwareStack(name="megatron-core", overlap_tp_comm=True),
    # Megatron-LM of 2021-22 (the vTrain measurements): no FlashAttention (scores materialized, fused
    # scale-mask-softmax), the "local" DDP all-reduces gradients after backward, blocking pipeline p2p,
    # and a Python-heavy layer with tensor-parallel RNG tracking and activation-checkpoint wrappers.
    "megatron-lm-2022": SoftwareStack(name="megatron-lm-2022", attention="unfused", overlap_grad_reduce=False,
                                      overlap_param_gather=False, async_p2p=False,
                                      host_seconds_per_kernel=50e-6, host_serialization=0.1),
    # fivefold's own runtime (runtime/parallelize.py, runtime/pipeline.py) on torch 2.13: SDPA (flash)
    # attention, no dropout in its models, DTensor TP whose input-gradient all-reduce is issued after the
    # whole matmul backward (no overlap with the weight gradient), FSDP2 / replicate with fp32 gradient
    # reduction. Without pp, FSDP2 reduces bucket by bucket under backward and prefetches gathers; ZeRO-2
    # (fully_shard, reshard_after_forward=False) frees its gathered weights after each backward. With
    # pp > 1, torch.distributed.pipelining's PipelineStage turns gradient sync and resharding after
    # backward off for every backward and runs REDUCE_GRAD once after the stage's last backward, and
    # the compute stream waits for it. Kernel-launch overhead is the default, not measured here.
    "fivefold": SoftwareStack(name="fivefold", dropout=False, overlap_tp_backward=False, grad_reduce_bytes=4,
                              pipeline_defers_grad_sync=True, zero2_reshards_after_backward=True),
}


def stack_named(name: str) -> SoftwareStack:
    if name not in STACKS:
        raise SpecError("--stack", name, f"unknown software stack; known: {', '.join(STACKS)}")
    return STACKS[name]


@dataclass(frozen=True)
class DataParallelSync:
    """Which data-parallel collectives a step runs, when, and what waits for them (FSDP2's own terms)."""

    reduce_every_micro_batch: bool  # gradients reduced after every micro-batch's backward (else once)
    reduce_overlapped: bool  # bucket by bucket during the weight-gradient pass; else after it, rank waits
    gathers_weights: bool  # ZeRO >= 1: updated weights are all-gathered (once per step unless resharded)
    reshard_after_forward: bool  # weights freed after a forward: the next pass gathers them again
    reshard_after_backward: bool  # weights freed after a backward: the next forward gathers them again
    gather_overlapped: bool  # layer by layer ahead of compute; else the pass waits for its whole gather
    grads_sharded: bool  # gradient memory is 1/N (ZeRO-2/3 reduce-scatter as they go)
    keeps_gathered: bool  # ZeRO-3 weights stay gathered from a backward to the next forward (memory: all)

    @property
    def gathers_once(self) -> bool:
        return self.gathers_weights and not (self.reshard_after_forward or self.reshard_after_backward)


def data_parallel_sync(stack: SoftwareStack, zero: int, pp: int) -> DataParallelSync:
    """The collective schedule of one ZeRO level under one stack.

    ZeRO-0 all-reduces gradients once per step; ZeRO-1 reduce-scatters them once and all-gathers the
    updated weights once; ZeRO-2 reduce-scatters every micro-batch; ZeRO-3 also frees the weights after
    every pass and gathers them again (FSDP). A stack with `pipeline_defers_grad_sync` under pp > 1
    reduces once per step at every level, blocking, and keeps weights gathered from a backward until the
    next forward."""
    key = (id(stack), zero, pp > 1)
    cached = _SYNC.get(key)
    if cached is not None and cached[0] is stack:
        return cached[1]
    defer = stack.pipeline_defers_grad_sync and pp > 1
    after_backward = not defer and (zero == 3 or (zero == 2 and stack.zero2_reshards_after_backward))
    sync = DataParallelSync(
        reduce_every_micro_batch=zero >= 2 and not defer, reduce_overlapped=stack.overlap_grad_reduce and not defer,
        gathers_weights=zero >= 1, reshard_after_forward=zero == 3, reshard_after_backward=after_backward,
        gather_overlapped=stack.overlap_param_gather, grads_sharded=zero >= 2 and not defer,
        keeps_gathered=zero == 3 and defer)
    _SYNC[key] = (stack, sync)
    return sync


_SYNC: dict[tuple, tuple[SoftwareStack, DataParallelSync]] = {}  # the planner asks ~10^5 times
