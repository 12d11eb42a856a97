"""Fit Hopper's kernel-shape parameters on the published kernel tables (issue 25) and print every row.

    .venv/bin/python bench/fit_kernels.py

Grid search of (benchmark-clock GEMM fraction, k_overhead, kernel latency) minimising the mean |log error|
over all 125 rows of OpenXLA's sm_90 BF16 matmul table, and of the FP8 fraction over DeepGEMM's table with
the same latency and FP8_K_FACTOR x k_overhead; the results are what cost/compute.py and cost/kernels.py
hold. Then scores them, unfitted, on OpenXLA's 2025 sm_90 run (BF16 and FP8 columns; why its FP8 column is
not fitted: cost/kernels.py). Sources: bench/reference/README.md.
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from fivefold.cost.kernels import benchmark_device, gemm_tflops  # noqa: E402
from fivefold.spec.devices import CATALOG  # noqa: E402

REFERENCE = ROOT / "bench" / "reference"


def rows(name: str) -> list[dict]:
    with open(REFERENCE / name) as handle:
        return list(csv.DictReader(handle))


def score(device, table: list[dict], fp8: bool) -> float:
    errors = []
    for row in table:
        m, n, k, groups = int(row["m"]), int(row["n"]), int(row["k"]), int(row.get("groups", 1))
        errors.append(abs(math.log(gemm_tflops(device, m, n, k, groups, fp8) / float(row["tflops"]))))
    return statistics.fmean(errors)


def with_profile(dtype: str, fraction: float, k_overhead: float, latency: float):
    device = benchmark_device(CATALOG["H100-SXM"], dtype)
    device.profile = replace(device.profile, k_overhead=k_overhead, kernel_latency=latency)
    device.latency = latency
    if dtype == "fp8":
        device.fp8_gemm_peak = CATALOG["H100-SXM"].flops("fp8") * fraction
    else:
        device.gemm_peak = device.peak * fraction
    return device


def main() -> int:
    bf16 = rows("xla_h100_bf16_gemm.csv")
    best = min((score(with_profile("bf16", f / 100, kover, lat * 1e-6), bf16, False), f / 100, kover, lat)
               for f in range(80, 96, 2) for kover in (128, 192, 256, 384) for lat in (3, 4, 5, 6))
    print(f"BF16 (OpenXLA sm_90, {len(bf16)} rows): mean |log error| {best[0]:.3f} at fraction {best[1]}, "
          f"k_overhead {best[2]}, latency {best[3]} us")
    fp8 = rows("deepgemm_h800_fp8.csv")
    best8 = min((score(with_profile("fp8", f / 100, best[2], best[3] * 1e-6), fp8, True), f / 100)
                for f in range(60, 90, 2))
    print(f"FP8 (DeepGEMM, {len(fp8)} rows, same k_overhead x1.5 and latency): mean |log error| {best8[0]:.3f} "
          f"at fraction {best8[1]}")
    check_openxla_2025(best, best8[1])
    return 0


def check_openxla_2025(bf16_fit: tuple, fp8_fraction: float) -> None:
    """Score the fitted parameters on OpenXLA's 2025 sm_90 run (BF16 and FP8 columns); nothing is fitted here."""
    table = rows("xla_h100_gemm_2025.csv")
    device = with_profile("bf16", bf16_fit[1], bf16_fit[2], bf16_fit[3] * 1e-6)
    for batch in ("1", "2", "4"):
        bf16 = [dict(row, tflops=row["bf16_tflops"], groups=batch) for row in table if row["batch"] == batch]
        print(f"BF16 (OpenXLA 2025 sm_90, batch {batch}, {len(bf16)} rows, not fitted): mean |log error| "
              f"{score(device, bf16, False):.3f}")
    # An FP8 GEMM does at most 2x a BF16 one's work per clock: rows past that are not whole-GEMM timings.
    fp8 = [dict(row, tflops=row["fp8_tflops"], groups=row["batch"]) for row in table]
    bounded = [row for row in fp8 if float(row["fp8_tflops"]) <= 2 * float(row["bf16_tflops"])]
    device8 = with_profile("fp8", fp8_fraction, bf16_fit[2], bf16_fit[3] * 1e-6)
    print(f"FP8 (OpenXLA 2025 sm_90, not fitted): {len(fp8) - len(bounded)} of {len(fp8)} rows above 2x "
          f"their BF16 rate; on the other {len(bounded)} the DeepGEMM-fitted curve has mean |log error| "
          f"{score(device8, bounded, True):.3f}")
    for low, high in ((0, 1e9), (1e9, 1e12)):
        band = [row for row in bounded
                if low <= 2 * int(row["batch"]) * int(row["m"]) * int(row["n"]) * int(row["k"]) < high]
        ratios = [gemm_tflops(device8, int(r["m"]), int(r["n"]), int(r["k"]), int(r["batch"]), True)
                  / float(r["tflops"]) for r in band]
        print(f"  {low:.0e}-{high:.0e} FLOP: {len(band)} rows, model / table median {statistics.median(ratios):.2f}"
              f", quartiles {statistics.quantiles(ratios, n=4)[0]:.2f}-{statistics.quantiles(ratios, n=4)[2]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
