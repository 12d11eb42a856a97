"""Time of one kernel on one device: GEMMs, fused attention and memory-bound element-wise work.

A GEMM runs at a fraction of the datasheet peak that depends on its shape, through three mechanisms:
- tile and wave quantization: the output is cut into tiles, one tile per streaming multiprocessor (SM) per
  wave; a last, partly filled wave wastes SMs. cuBLAS picks among several tile shapes (smaller tiles waste
  fewer SMs but reuse less data), so we take the best of a few (tile, relative speed) options;
- main-loop amortization: each tile pays a fixed prologue/epilogue worth `k_overhead` of reduction depth,
  so a GEMM with a short K runs at K / (K + k_overhead) of its best speed;
- the roofline: a GEMM cannot run faster than moving its operands through device memory.
Element-wise kernels (norms, activations, dropout, softmax, residual adds) are memory-bound: bytes moved
over the achievable memory bandwidth. Every kernel also pays a fixed launch-to-finish latency.

The parameters below describe a device generation, not a measurement row. Sources: SM counts from the
vendor architecture whitepapers (A100: 108 SMs, H100 SXM: 132, H100 PCIe: 114, B200: 148 per GPU,
L40S: 142, RTX 4090: 128, MI300X: 304 CUs). Sustained fractions of peak are typical large-GEMM results of
cuBLAS/hipBLASLt at training clocks (A100 ~0.8 of 312 TFLOP/s; H100 ~0.7 of 989 under its power limit;
MI300X ~0.55 of 1307), and ~0.8 of datasheet memory bandwidth for streaming kernels (STREAM-like copies).
FlashAttention-2 (Dao 2023) reaches ~0.7 of the GEMM rate forward and ~0.55 backward.

Measured curves: a cluster group profiled by `fivefold profile` carries GEMM throughput points
(m, n, k, dtype, FLOP/s). A device with points for the training dtype takes every GEMM's rate from them
instead of the tile/K-overhead/roofline model: log FLOP/s interpolated piecewise-linearly over log
arithmetic intensity (FLOPs per byte of A, B and C moved, which grows with size and falls for skinny
shapes), clamped to the end points outside the measured range; fused attention scales with the best
measured rate as it scales with `gemm_peak` otherwise. A CPU profile also carries the host costs of the
eager runtime (Calibration.host): the device then keeps them (Device.host) for the stack to charge per
op, takes the measured memory bandwidth as achieved, and adds no per-kernel latency of its own.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

from fivefold.cost.cache import IdentityCache, Missing
from fivefold.spec.cluster import Calibration, HostCosts
from fivefold.spec.devices import DeviceSpec


@dataclass(frozen=True)
class ComputeProfile:
    """How close one device generation gets to its datasheet numbers."""

    sm_count: int  # streaming multiprocessors (compute units): GEMM tiles run one per SM per wave
    gemm_fraction: float  # sustained fraction of dense peak on large GEMMs
    attention_forward: float  # fused-attention forward speed relative to a large GEMM
    attention_backward: float  # fused-attention backward speed relative to a large GEMM
    memory_fraction: float  # achievable fraction of memory bandwidth in streaming kernels
    kernel_latency: float  # seconds every kernel costs on the device (launch, ramp-up, tail)
    k_overhead: float  # reduction depth worth of a GEMM tile's fixed prologue/epilogue cycles (elements of K)
    fp8_gemm_fraction: float = 0.0  # sustained fraction of the FP8 dense peak on large FP8 GEMMs (0: no FP8)
    flash2_speed: float = 1.0  # FlashAttention-2 relative to the generation's best fused attention kernel


PROFILES: dict[str, ComputeProfile] = {
    # Ampere's k_overhead (96) and latency (4 us) are generation estimates: no published per-shape A100 GEMM
    # table was found (OpenXLA's matmul tables have sm_90 and sm_100 keys only; cost/kernels.py), so only the
    # end-to-end A100 rows (vTrain, Korthikanti) check them.
    "A100-40GB": ComputeProfile(108, 0.80, 0.70, 0.55, 0.80, 4e-6, 96.0),
    "A100-80GB": ComputeProfile(108, 0.80, 0.70, 0.55, 0.80, 4e-6, 96.0),
    # Hopper and Blackwell tensor cores do 2-4x more work per SM clock than Ampere, so the fixed cycles
    # of a tile's prologue/epilogue are worth proportionally more reduction depth.
    # FP8 GEMMs (E4M3/E5M2 with fp32 accumulation) reach a smaller share of their doubled peak than BF16
    # ones (cuBLASLt on H100: ~1.2-1.3 of 1.98 PFLOP/s at training clocks, ~0.6), and a tile's fixed
    # cycles are worth 1.5x the reduction depth (DeepGEMM's table fits 384 against BF16's 256): FP8_K_FACTOR.
    # FlashAttention-2 has no Hopper wgmma/TMA path: ~35% of H100's peak where FlashAttention-3 and cuDNN
    # reach 60-75% (Shah et al. 2024, FlashAttention-3, Fig. 5-6); the attention figures above are the
    # latter's, so FA2 (PyTorch SDPA's flash backend) runs at ~0.75 of them on Hopper.
    # Hopper's k_overhead (256) and kernel latency (5 us) reproduce OpenXLA's measured cuBLAS table and
    # DeepGEMM's FP8 tables, and OpenXLA's 2025 sm_90 run at batch 1-4 without refitting (cost/kernels.py,
    # tests/test_cost_kernels.py); gemm_fraction is the level a training step sustains (end-to-end
    # development set), below the table's boost-clock level.
    "H100-SXM": ComputeProfile(132, 0.68, 0.70, 0.55, 0.80, 5e-6, 256.0, 0.60, 0.75),
    "H100-PCIe": ComputeProfile(114, 0.68, 0.70, 0.55, 0.80, 5e-6, 256.0, 0.60, 0.75),
    # At a 500 W cap the tensor cores run at lower clocks under dense GEMM load: ~550 TFLOP/s sustained in
    # BF16, and FP8 GEMMs (more work per clock, more power) gain ~1.5x over that rather than ~1.8x.
    "H100-96GB": ComputeProfile(132, 0.60, 0.70, 0.55, 0.80, 5e-6, 256.0, 0.45, 0.75),
    "H200": ComputeProfile(132, 0.70, 0.70, 0.55, 0.80, 5e-6, 256.0, 0.62, 0.75),
    # B200's shape terms from OpenXLA's 2025 sm_100 table (cost/kernels.py): Hopper's 256 and 5 us fit it at a
    # mean |log error| of 0.053 (BF16) / 0.080 (FP8) where the former unsourced 384 and 4 us gave 0.121 / 0.158.
    "B200": ComputeProfile(148, 0.68, 0.70, 0.55, 0.80, 5e-6, 256.0, 0.60),
    "L40S": ComputeProfile(142, 0.75, 0.65, 0.50, 0.80, 4e-6, 96.0, 0.65),
    "RTX-4090": ComputeProfile(128, 0.80, 0.65, 0.50, 0.80, 4e-6, 96.0, 0.70),
    "MI300X": ComputeProfile(304, 0.55, 0.60, 0.45, 0.75, 6e-6, 192.0, 0.50),
    # One CPU worker: few "SMs" (cores), no tensor cores; the catalog peak is itself a placeholder.
    "cpu": ComputeProfile(4, 0.50, 0.50, 0.40, 0.60, 20e-6, 16.0),
}
DEFAULT_PROFILE = ComputeProfile(128, 0.70, 0.65, 0.50, 0.80, 5e-6, 128.0, 0.60)
FP8_K_FACTOR = 1.5

# (tile rows, tile cols, speed relative to the largest tile): smaller tiles fill more SMs but reuse less.
TILE_OPTIONS = ((256, 128, 1.0), (128, 128, 0.93), (128, 64, 0.82), (64, 64, 0.65))


def profile_of(device: DeviceSpec) -> ComputeProfile:
    return PROFILES.get(device.name, DEFAULT_PROFILE)


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def arithmetic_intensity(m: int, n: int, k: int, element_bytes: int) -> float:
    """FLOPs per byte a GEMM moves through memory: 2mnk over A, B and C read or written once."""
    return 2.0 * m * n * k / ((m * k + k * n + m * n) * element_bytes)


class GemmCurve:
    """Measured GEMM throughput of one dtype over arithmetic intensity, interpolated in log-log."""

    def __init__(self, points: list[tuple[float, float]]) -> None:
        by_intensity: dict[float, list[float]] = {}
        for intensity, rate in points:
            by_intensity.setdefault(math.log(intensity), []).append(math.log(rate))
        self.x = sorted(by_intensity)
        self.y = [sum(by_intensity[x]) / len(by_intensity[x]) for x in self.x]  # shapes of equal intensity
        self.best = math.exp(max(self.y))

    def rate(self, intensity: float) -> float:
        """FLOP/s at this intensity: interpolated inside the measured range, the end value outside."""
        x, xs, ys = math.log(intensity), self.x, self.y
        if x <= xs[0]:
            return math.exp(ys[0])
        if x >= xs[-1]:
            return math.exp(ys[-1])
        i = bisect_right(xs, x)
        share = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return math.exp(ys[i - 1] + share * (ys[i] - ys[i - 1]))


_CURVES: IdentityCache[GemmCurve | None] = IdentityCache(64)


def gemm_curve(calibration: Calibration | None, dtype: str) -> GemmCurve | None:
    """The measured GEMM curve of a calibration for one dtype, or None without points (cached)."""
    if calibration is None or not calibration.gemm:
        return None
    cached = _CURVES.get(calibration, dtype)
    if not isinstance(cached, Missing):
        return cached
    element_bytes = dtype_bytes(dtype)
    points = [(arithmetic_intensity(m, n, k, element_bytes), rate)
              for m, n, k, point_dtype, rate in calibration.gemm if point_dtype == dtype and rate > 0]
    return _CURVES.put(calibration, dtype, GemmCurve(points) if points else None)


class Device:
    """A device and a training dtype, with the few numbers every kernel-time formula needs."""

    __slots__ = ("spec", "profile", "peak", "bandwidth", "gemm_peak", "latency", "element_bytes", "gemm_curve",
                 "host", "fp8_gemm_peak")

    def __init__(self, spec: DeviceSpec, dtype: str, calibration: Calibration | None = None) -> None:
        self.spec = spec
        self.profile = profile_of(spec)
        # FP8 training runs its block GEMMs in FP8 and the rest (attention, LM head, element-wise) in BF16:
        # the BF16 peak is the basis of MFU and of every non-FP8 kernel.
        fp8 = dtype == "fp8"
        self.peak = spec.flops("bf16" if fp8 else dtype)  # dense FLOP/s of the dtype
        # Measured host costs mark a profiled CPU rank: its memory bandwidth is the profile's STREAM copy
        # (already what a rank achieves among N), and the fixed cost of an op is its host cost, which an
        # eager stack counts per op (cost/step.py), so the catalog's per-kernel latency is not added.
        self.host: HostCosts | None = calibration.host if calibration is not None else None
        fraction = 1.0 if self.host is not None else self.profile.memory_fraction
        self.bandwidth = spec.memory_bandwidth * fraction  # achievable bytes/s
        self.latency = 0.0 if self.host is not None else self.profile.kernel_latency
        self.element_bytes = dtype_bytes(dtype)
        self.gemm_curve = gemm_curve(calibration, dtype)  # measured GEMM rates, when profiled
        # FLOP/s of a large, well-shaped GEMM: the best measured one, else the catalog fraction of peak.
        self.gemm_peak = self.gemm_curve.best if self.gemm_curve else self.peak * self.profile.gemm_fraction
        # Large FP8 GEMMs: the FP8 peak times the generation's own sustained fraction (0.0: no FP8).
        self.fp8_gemm_peak = spec.flops("fp8") * self.profile.fp8_gemm_fraction if fp8 else 0.0


def tile_utilization(rows: int, cols: int, batch: int, sm_count: int) -> float:
    """Best fraction of the SMs doing useful work over the tile options (wave and tile quantization)."""
    best = 0.0
    for tile_rows, tile_cols, speed in TILE_OPTIONS:
        row_tiles = -(-rows // tile_rows)
        col_tiles = -(-cols // tile_cols)
        tiles = row_tiles * col_tiles * batch
        waves = -(-tiles // sm_count)
        # Useful work / work of the launched tiles, times the share of SM slots used in all waves.
        fill = (rows * cols) / (row_tiles * tile_rows * col_tiles * tile_cols)
        utilization = speed * fill * tiles / (waves * sm_count)
        if utilization > best:
            best = utilization
    return best


def gemm_time(device: Device, m: int, n: int, k: int, batch: int = 1, fp8: bool = False) -> float:
    """Seconds of C[m, n] = A[m, k] @ B[k, n] (`batch` independent copies): compute or memory bound.
    `fp8`: A and B in FP8 (1 byte), C in BF16, at the FP8 rate and its own efficiency curve (when the
    device trains in FP8)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    if fp8 and device.fp8_gemm_peak > 0:
        k_overhead = device.profile.k_overhead * FP8_K_FACTOR
        efficiency = tile_utilization(m, n, batch, device.profile.sm_count) * k / (k + k_overhead)
        compute = flops / (device.fp8_gemm_peak * efficiency)
        memory = (m * k + k * n + 2 * m * n) * batch / device.bandwidth
        return max(compute, memory) + device.latency
    if device.gemm_curve is not None:  # measured: the rate of this shape's intensity, never below a launch
        return max(flops / device.gemm_curve.rate(arithmetic_intensity(m, n, k, device.element_bytes)),
                   device.latency)
    efficiency = tile_utilization(m, n, batch, device.profile.sm_count) * k / (k + device.profile.k_overhead)
    compute = flops / (device.gemm_peak * efficiency)
    memory = (m * k + k * n + m * n) * batch * device.element_bytes / device.bandwidth
    return max(compute, memory) + device.latency


def elementwise_time(device: Device, num_bytes: float, kernels: int = 1) -> float:
    """Seconds of memory-bound kernels moving `num_bytes` in total."""
    return num_bytes / device.bandwidth + kernels * device.latency


def flash_attention_time(device: Device, batch_heads: int, q_len: int, kv_len: int, head_dim: int,
                         causal: bool, backward: bool, window: int = 0, flash2: bool = False) -> float:
    """Seconds of a fused (FlashAttention-style) attention kernel over `batch_heads` (batch x local heads).

    Forward does 2 matmuls (Q K^T, P V) of 2 * q * kv * d FLOPs each; backward does 5 (it recomputes P),
    i.e. 2.5x forward. A causal mask skips about half the blocks. Query blocks of 128 rows are the tiles.
    """
    flops = 4.0 * batch_heads * q_len * kv_len * head_dim * (2.5 if backward else 1.0)
    if causal and 0 < window < kv_len:
        # A causal sliding window: each query sees up to `window` keys (fewer in the first window), and
        # the key blocks that cut the band's two edges run whole.
        keys = window * (1.0 - window / (2.0 * kv_len)) + 128.0
        flops *= min(1.0, keys / kv_len)
        kv_len = min(kv_len, window + 128)  # what one query block reads (the roofline's memory term)
    elif causal:
        flops *= 0.5 * (1.0 + 1.0 / max(1, -(-kv_len // 128)))  # the diagonal blocks run whole
    relative = device.profile.attention_backward if backward else device.profile.attention_forward
    if flash2:  # the kernel PyTorch's SDPA runs (FlashAttention-2), not the generation's best
        relative *= device.profile.flash2_speed
    # Larger heads do more matmul per softmax element: FlashAttention-3's forward at 16k runs 497 / 649 / 756
    # TFLOP/s at head_dim 64 / 128 / 256 (Shah et al. 2024, Fig. 5), close to (d / 128) ** 0.25.
    relative *= (head_dim / 128.0) ** 0.25
    utilization = tile_utilization(q_len, 128, batch_heads, device.profile.sm_count)
    compute = flops / (device.gemm_peak * relative * utilization)
    memory = 4.0 * batch_heads * (q_len + kv_len) * head_dim * device.element_bytes / device.bandwidth
    return max(compute, memory) + device.latency

