"""Fit Hopper's kernel-shape parameters on the published kernel tables (issue 25) and print every row.

    .venv/bin/python bench/fit_kernels.py

Grid search of (benchmark-clock GEMM fraction, k_overhead, kernel latency) minimising the mean |log error|
over all 125 rows of OpenXLA's sm_90 BF16 matmul table, and of the FP8 fraction over DeepGEMM's table with
the same latency and FP8_K_FACTOR x k_overhead; the results are what cost/compute.py and cost/kernels.py
hold. Then scores them, unfitted, on OpenXLA's 2025 sm_90 run (BF16 and FP8 columns; why its FP8 column is
not fitted: cost/kernels.py), and prints the B200 profile's shape parameters against the same file's sm_100
rows next to the grid optimum there (the B200 profile takes the optimum). Sources: bench/reference/README.md.
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

from fivefold.cost.compute import PROFILES, Device  # noqa: E402
from fivefold.cost.kernels import gemm_tflops  # noqa: E402
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


def with_profile(dtype: str, fraction: float, k_overhead: float, latency: float, name: str = "H100-SXM"):
    """The catalog device `name` with these shape parameters, at `fraction` of its peak for large GEMMs."""
    device = Device(CATALOG[name], dtype)
    device.profile = replace(device.profile, k_overhead=k_overhead, kernel_latency=latency)
    device.latency = latency
    if dtype == "fp8":
        device.fp8_gemm_peak = CATALOG[name].flops("fp8") * fraction
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
    check_openxla_b200()
    return 0


def check_openxla_b200() -> None:
    """B200 (OpenXLA's sm_100 rows): the catalog profile's shape parameters against the grid optimum. Printed
    for the record; the B200 profile holds the optimum (cost/kernels.py)."""
    table = rows("xla_b200_gemm_2025.csv")
    bf16 = [dict(row, tflops=row["bf16_tflops"]) for row in table]
    fp8 = [dict(row, tflops=row["fp8_tflops"]) for row in table]
    profile = PROFILES["B200"]
    for label, k_overhead, latency in (("catalog", profile.k_overhead, profile.kernel_latency * 1e6),
                                       ("grid optimum", None, None)):
        grid = [(f / 100, kover, lat) for f in range(60, 96, 2) for kover in (128, 192, 256, 384, 512)
                for lat in (3, 4, 5, 6, 7) if k_overhead is None or (kover, lat) == (k_overhead, latency)]
        err, frac, kover, lat = min((score(with_profile("bf16", f, ko, la * 1e-6, "B200"), bf16, False), f, ko, la)
                                    for f, ko, la in grid)
        err8, frac8 = min((score(with_profile("fp8", f / 100, kover, lat * 1e-6, "B200"), fp8, True), f / 100)
                          for f in range(40, 96, 2))
        print(f"B200 (OpenXLA 2025 sm_100, {len(table)} rows), {label}: k_overhead {kover:g}, latency {lat:g} us: "
              f"BF16 mean |log error| {err:.3f} at fraction {frac}; FP8 {err8:.3f} at fraction {frac8}")


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
