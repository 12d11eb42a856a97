"""The local experts' GEMMs of an MoE block (cost/moe_block.py calls expert_gemms): as the stack launches them (one
grouped launch, a GEMM per expert on k streams, or fivefold's torch._grouped_mm), at the rows each expert gets
under the router's measured load.
"""

from __future__ import annotations

import copy
from typing import Callable

from fivefold.cost.compute import Device, gemm_time
from fivefold.cost.passwork import PassWork, fp8_linear, mlp
from fivefold.cost.stack import SoftwareStack

# torch._grouped_mm on the GPUs whose torch runs it (CUTLASS's sm90+ grouped GEMM; models/moe.py GROUPED_MM_CAPABILITY).
GROUPED_MM_DEVICES = frozenset({"H100-SXM", "H100-PCIe", "H100-96GB", "H200", "B200"})
# One grouped GEMM over E experts of T rows each, x[E*T, K] by w[E, K, N], as a roofline of its tiles' compute and
# the weights and rows it moves, fitted on reference/measured/h200_grouped.csv (H200, torch 2.11, 16 shapes: 8 to
# 128 experts, 16 to 1024 rows each; every one within 10%, mean 5.8%): an expert's rows fill tiles of 64 rows,
# which run at 0.96 of the device's large-GEMM rate; weights and rows move at 0.78 of its achievable bandwidth.
# Few rows per expert leave it bound by reading every expert's weights (16 rows: 42 TFLOP/s; 1024: 706).
GROUPED_TILE_ROWS = 64
GROUPED_COMPUTE_SHARE = 0.96
GROUPED_BANDWIDTH_SHARE = 0.78


def runs_grouped_mm(stack: SoftwareStack, device: Device) -> bool:
    """Whether the stack's experts run as torch._grouped_mm on this device (SoftwareStack.grouped_mm_experts):
    fivefold's on the GPUs of GROUPED_MM_DEVICES in bf16 (fp8 training keeps its experts in BF16)."""
    if stack.grouped_mm_experts == "always":
        return True
    return stack.grouped_mm_experts == "gpu" and device.spec.name in GROUPED_MM_DEVICES and device.element_bytes == 2


def grouped_gemm_time(device: Device, rows: int, n: int, k: int, experts: int, row_tiles: bool = True) -> float:
    """Seconds of one grouped GEMM: `experts` groups of y[rows, n] = x[rows, k] w[k, n]. `row_tiles`: the rows are
    an output dimension, cut into GROUPED_TILE_ROWS-row tiles (forward, dgrad); False for the weight gradient,
    where they are the contraction. Off the fitted GPUs (a CPU with --expert-gemm grouped) the batched GEMM of
    cost/compute.py."""
    if rows <= 0:
        return device.latency
    if device.spec.name not in GROUPED_MM_DEVICES:
        return gemm_time(device, rows, n, k, experts)
    padded = -(-rows // GROUPED_TILE_ROWS) * GROUPED_TILE_ROWS if row_tiles else rows
    compute = 2.0 * experts * padded * n * k / (device.gemm_peak * GROUPED_COMPUTE_SHARE)
    moved = experts * (n * k + rows * (n + k)) * device.element_bytes
    return max(compute, moved / (device.bandwidth * GROUPED_BANDWIDTH_SHARE)) + device.latency


def active_experts(experts: int, load: float) -> int:
    """Experts that get rows when the busiest gets `load` x the mean (TrainSpec.expert_load): the rows crowd onto
    experts / load of them (load E / top_k: every token to the same top_k experts)."""
    return max(1, min(experts, round(experts / max(1.0, load))))


def expert_gemms(work: PassWork, device: Device, stack: SoftwareStack, rows: int, hidden: int, width: int,
                 swiglu: bool, experts: int, load: float = 1.0
                 ) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """The local experts' MLPs: one grouped launch whose tiles share the waves (stack.grouped_gemm_streams 0), or
    one GEMM per expert with `streams` of them running side by side (Transformer Engine's GroupedLinear:
    nvte_multi_stream_cublas_gemm issues a cuBLAS GEMM per expert over its compute streams; fivefold's
    GroupedExperts: one expert after the other on one stream), so only the tiles of `streams` experts share a
    wave. Same FLOPs; the difference is the wave quantization of few rows per expert. Every expert has the same
    rows here, so a group of `streams` experts is costed once and counted as often as it runs. fivefold's
    torch._grouped_mm (runs_grouped_mm): three grouped GEMMs (_grouped_expert_mlp). `load`: the rows crowd onto
    active_experts of them; the rest launch with none (their GEMMs a launch latency each)."""
    active = active_experts(experts, load)
    rows = max(1, round(rows * experts / active))
    if not stack.fp8_experts and device.fp8_gemm_peak > 0:  # the experts stay in BF16 under FP8 training
        device = copy.copy(device)
        device.fp8_gemm_peak = 0.0
    if runs_grouped_mm(stack, device):
        return _grouped_expert_mlp(work, device, rows, hidden, width, swiglu, active)
    if active < experts:  # the empty experts' GEMMs (forward, dgrad and wgrad each): launches, no rows
        empty = (experts - active) * (3 if swiglu and stack.expert_gate_separate else 2)
        work.elementwise(device, 0.0, 0.0, empty, 2 * empty)
    experts = active
    streams = stack.grouped_gemm_streams
    if streams <= 0 or (streams >= experts and not stack.expert_gate_separate):
        return mlp(work, device, stack, rows, hidden, width, swiglu, experts)
    full, rest = divmod(experts, min(streams, experts))
    sums = _repeated(work, full, lambda into: _expert_mlp(into, device, stack, rows, hidden, width, swiglu, streams))
    if rest:
        last = _repeated(work, 1, lambda into: _expert_mlp(into, device, stack, rows, hidden, width, swiglu, rest))
        sums = [a + b for a, b in zip(sums, last)]
    return (sums[0], sums[1], sums[2]), (sums[3], sums[4], sums[5])


def _grouped_expert_mlp(work: PassWork, device: Device, rows: int, hidden: int, width: int, swiglu: bool,
                        experts: int) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """models/moe.py's grouped experts: torch._grouped_mm for the gate, the up (SwiGLU) and the down projection,
    forward, dgrad and wgrad each a grouped GEMM (grouped_gemm_time), and the activation between."""

    def linear(k: int, n: int) -> tuple[float, float, float]:
        forward = grouped_gemm_time(device, rows, n, k, experts)
        dgrad = grouped_gemm_time(device, rows, k, n, experts)
        wgrad = grouped_gemm_time(device, rows, n, k, experts, row_tiles=False)
        work.forward += forward
        work.linear_forward += forward
        work.backward_input += dgrad
        work.backward_weight += wgrad
        work.forward_kernels += 1
        work.backward_kernels += 2
        return forward, dgrad, wgrad

    gate = linear(hidden, width)
    up = linear(hidden, width) if swiglu else (0.0, 0.0, 0.0)
    e, activation = device.element_bytes, rows * experts * width
    work.elementwise(device, activation * (3 if swiglu else 2) * e, activation * (5 if swiglu else 3) * e)
    down = linear(width, hidden)
    return (gate[0] + up[0], gate[1] + up[1], gate[2] + up[2]), down


def _expert_mlp(work: PassWork, device: Device, stack: SoftwareStack, rows: int, hidden: int, width: int,
                swiglu: bool, side_by_side: int) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """`side_by_side` experts' MLPs launched together; with stack.expert_gate_separate a SwiGLU expert's gate and
    up projections are two GEMMs of `width` columns (fivefold's GroupedExperts: chunk @ w1.T, chunk @ w3.T), not
    one of 2 x width, so each fills its own waves."""
    if not (swiglu and stack.expert_gate_separate):
        return mlp(work, device, stack, rows, hidden, width, swiglu, side_by_side)
    gate = fp8_linear(work, device, stack, rows, hidden, width, side_by_side)
    up = fp8_linear(work, device, stack, rows, hidden, width, side_by_side)
    e = device.element_bytes
    work.elementwise(device, rows * side_by_side * width * 3 * e, rows * side_by_side * width * 5 * e)
    down = fp8_linear(work, device, stack, rows, width, hidden, side_by_side)
    return (gate[0] + up[0], gate[1] + up[1], gate[2] + up[2]), down


def _repeated(work: PassWork, times: int, add: Callable[[PassWork], tuple[tuple[float, float, float],
                                                                          tuple[float, float, float]]]) -> list[float]:
    """Run `add` on a scratch PassWork and add its GPU seconds and kernels `times` over to `work` (the planner
    would otherwise cost the same expert MLP once per local expert); its (up, down) GEMM times, summed."""
    scratch = PassWork()
    up, down = add(scratch)
    work.forward += times * scratch.forward
    work.linear_forward += times * scratch.linear_forward
    work.backward_input += times * scratch.backward_input
    work.backward_weight += times * scratch.backward_weight
    work.forward_kernels += times * scratch.forward_kernels
    work.backward_kernels += times * scratch.backward_kernels
    return [times * seconds for seconds in (*up, *down)]
