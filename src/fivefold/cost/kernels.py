"""The op-level compute model checked against published kernel measurements (issue 25).

cost/compute.py times every kernel from a few mechanisms (tile and wave quantization over the SMs, a tile's
fixed prologue/epilogue worth `k_overhead` of reduction depth, the memory roofline, a fixed per-kernel
latency). Their shape parameters for Hopper are fitted here on published tables of single kernels, never on
a training row, and tests/test_cost_kernels.py reproduces every row of those tables:

- BF16 GEMMs on H100 SXM: OpenXLA's measured matmul table (xla/service/gpu/model/matmul_interpolator_data.h,
  "sm_90", cuBLAS, 125 shapes m, n, k in 256..4096, batch 1): bench/reference/xla_h100_bf16_gemm.csv;
- FP8 GEMMs on H800 SXM (H100 compute, 132 SMs, 1979 FP8 TFLOP/s): DeepGEMM's README performance tables
  (deepseek-ai/DeepGEMM at 55ab91f, 2025-03-25: dense GEMMs of DeepSeek-V3's shapes, grouped GEMMs in the
  contiguous and masked layouts, i.e. experts at 256-8192 tokens each), with the speed-up over their CUTLASS
  3.6 baseline: bench/reference/deepgemm_h800_fp8.csv;
- fused attention on H100 SXM: FlashAttention-3 (Shah et al. 2024, Fig. 5) forward speeds at sequence length
  16k by head dimension and causality: bench/reference/flash_attention_h100.csv.

OpenXLA's 2025 table (xla/backends/gpu/cost_model/matmul_interpolator_data.h: keys "sm_100" and "sm_90" only,
batch 1/2/4, bf16, f32 and three FP8 pairs; bench/reference/xla_h100_gemm_2025.csv) is a second sm_90 run.
Its BF16 column, 375 rows, is reproduced by the parameters fitted above without refitting: mean |log error|
0.045 / 0.041 / 0.059 at batch 1 / 2 / 4 (the older table: 0.047), so batched GEMMs, whose tiles share the
waves as grouped ones do here, follow the same shape terms. (The grid optimum on all 500 BF16 rows is
k_overhead 192 at fraction 0.90, 0.046 against today's 0.048, and fits DeepGEMM's FP8 rows worse, 0.135
against 0.130: kept.) Its FP8 column (e4m3 x e4m3 -> bf16, a dot with no scaling ops, lowered by XLA) is
not fitted: 86 of 375 rows run at more than twice the same shape's BF16 rate (the FP8 tensor-core rate per
clock is 2x BF16's), 29 pass the 1979 TFLOP/s FP8 dense peak (2593 at 4 x 4096^3), and it is not monotone
(256x1024x256 takes 8.5 us, 256x1024x512 5.6 us), so those are not whole-GEMM times. On its 289 other rows
the DeepGEMM-fitted FP8 curve is at a median 1.45x the table below 1 GFLOP (where XLA's FP8 GEMMs run slower
than its BF16 ones) and 0.86x above (quartiles 0.76-0.94); bench/fit_kernels.py prints these.
There is no "sm_80" key and no other published per-shape A100 table was found, so A100's shape parameters
(cost/compute.py) are the generation's estimates, checked only end to end (vTrain's and Korthikanti's rows).
The file's "sm_100" rows (B200, bench/reference/xla_b200_gemm_2025.csv, 125 shapes) set B200's shape terms:
the earlier unsourced profile (k_overhead 384, 4 us) met them at mean |log error| 0.121 (BF16) / 0.158 (FP8);
the grid optimum is Hopper's 256 and 5 us, at 0.053 / 0.080 (benchmark fractions 0.78 BF16, 0.70 FP8), now
the B200 profile's (bench/fit_kernels.py prints both; tests/test_cost_kernels.py reproduces the rows).

A kernel table is measured at boost clocks on an idle GPU for microseconds; a training step runs every GEMM
under the power limit. So the level (the sustained fraction of peak, `ComputeProfile.gemm_fraction`) stays a
device constant calibrated on the end-to-end development set, and the table fixes the *shape* of the curve:
the benchmark fraction below is what the same mechanisms need to reproduce the table at benchmark clocks,
and `sustained_clock` = gemm_fraction / benchmark fraction is the share of it a training step keeps
(H100 SXM: 0.68 / 0.92 = 0.74, i.e. ~1.45 of 1.98 GHz, in line with the 1.4-1.7 GHz H100s hold under
sustained tensor-core load). One large-GEMM efficiency per device does not describe a 256 x 2048 x 256 GEMM
(42 TFLOP/s measured) and a 4096^3 one (783 TFLOP/s) alike; the shape terms do.

Grouped GEMMs (MoE experts): one launch over the local experts, each with the rows routed to it; the tiles
of all experts share the waves (DeepGEMM's contiguous and masked layouts), and each expert reads its own
weights, which is what makes few tokens per expert memory-bound.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fivefold.cost.compute import PROFILES, ComputeProfile, Device, gemm_time
from fivefold.spec.devices import DeviceSpec


@dataclass(frozen=True)
class BenchmarkClocks:
    """What one device generation reaches in the published kernel tables (boost clocks, idle GPU)."""

    gemm_fraction: float  # BF16 large-GEMM share of the dense peak in the table
    fp8_gemm_fraction: float  # FP8 large-GEMM share of the FP8 peak in the table
    source: str


# Fitted by bench/fit_kernels.py on the tables above (grid search of the mean |log error| over every row;
# the fitted k_overhead and latency are the ones in cost/compute.py's H100 profiles).
BENCHMARK_CLOCKS: dict[str, BenchmarkClocks] = {
    "H100-SXM": BenchmarkClocks(0.92, 0.74, "OpenXLA sm_90 matmul table (BF16); DeepGEMM README (FP8, H800)"),
    "B200": BenchmarkClocks(0.78, 0.70, "OpenXLA 2025 sm_100 matmul table (BF16 and FP8 columns)"),
}


def sustained_clock(device_name: str) -> float | None:
    """The share of its benchmark-clock GEMM rate a device keeps in a training step (None: no table)."""
    clocks = BENCHMARK_CLOCKS.get(device_name)
    if clocks is None:
        return None
    return PROFILES[device_name].gemm_fraction / clocks.gemm_fraction


def benchmark_device(spec: DeviceSpec, dtype: str) -> Device:
    """The device as the kernel tables measured it: the same shape terms at the benchmark-clock level."""
    clocks = BENCHMARK_CLOCKS[spec.name]
    device = Device(spec, dtype)
    profile: ComputeProfile = replace(device.profile, gemm_fraction=clocks.gemm_fraction,
                                      fp8_gemm_fraction=clocks.fp8_gemm_fraction)
    device.profile = profile
    device.gemm_peak = device.peak * clocks.gemm_fraction
    if dtype == "fp8":
        device.fp8_gemm_peak = spec.flops("fp8") * clocks.fp8_gemm_fraction
    return device


def grouped_gemm_time(device: Device, rows_per_expert: int, n: int, k: int, experts: int,
                      fp8: bool = False) -> float:
    """Seconds of one grouped GEMM: `experts` GEMMs [rows_per_expert, k] x [k, n] in one launch (their
    tiles share the waves; each reads its own [k, n] weights)."""
    if experts <= 0 or rows_per_expert <= 0:
        return 0.0
    return gemm_time(device, rows_per_expert, n, k, batch=experts, fp8=fp8)


def gemm_tflops(device: Device, m: int, n: int, k: int, batch: int = 1, fp8: bool = False) -> float:
    """Achieved TFLOP/s of a (batched) GEMM under the op model."""
    return 2.0 * m * n * k * batch / gemm_time(device, m, n, k, batch, fp8) / 1e12
