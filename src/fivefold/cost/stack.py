"""SoftwareStack: what the training software does that a Plan does not say.

The same plan runs at different speeds under different software: fused attention or not, gradient
reduction overlapped with backward or not, how much CPU time each kernel launch costs. These are
properties of the framework version, never of one measurement, so they live here as named presets.
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
}


def stack_named(name: str) -> SoftwareStack:
    if name not in STACKS:
        raise SpecError("--stack", name, f"unknown software stack; known: {', '.join(STACKS)}")
    return STACKS[name]
