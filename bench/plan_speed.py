"""Speed of the cost model and the planner, on one CPU core.

    .venv/bin/python bench/plan_speed.py

Targets (issue 3): estimating one plan under 1 ms; a full search for the 1T-parameter GPT (preset gpt-1t)
on 3072 GPUs under 2 s. The search runs first, in this fresh process, so its caches start cold. A search
and an estimate on a cluster carrying measured curves (a `fivefold profile` calibration) show what
interpolating GEMM rates and collective times costs.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from fivefold.cost import estimate  # noqa: E402
from fivefold.planner import search  # noqa: E402
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster  # noqa: E402
from fivefold.spec.cluster import Calibration, ClusterSpec  # noqa: E402


def calibrated(text: str) -> ClusterSpec:
    """The cluster with made-up measured curves on its first group: square bf16 GEMMs and 8-rank
    collectives from 64 KiB to 256 MiB (what `fivefold profile` writes, at plausible H100 numbers)."""
    cluster = parse_cluster(text)
    gemm = tuple((n, n, n, "bf16", rate) for n, rate in ((512, 2e14), (1024, 4.5e14), (2048, 6e14), (4096, 6.6e14),
                                                        (8192, 6.8e14)))
    sizes = [2**p for p in range(16, 29, 2)]
    collectives = tuple((kind, 8, size, 20e-6 + size * factor / 360e9) for kind, factor in
                        (("all_reduce", 1.75), ("all_gather", 7.0), ("reduce_scatter", 0.875),
                         ("all_to_all", 0.875), ("send_recv", 1.0)) for size in sizes)
    group = cluster.groups[0]
    groups = (type(group)(**{**group.__dict__, "calibration": Calibration(gemm, collectives, "bench")}),)
    return ClusterSpec(groups + cluster.groups[1:], cluster.between_groups_bandwidth, cluster.between_groups_latency)


def pin_to_one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        core = sorted(os.sched_getaffinity(0))[0]
        os.sched_setaffinity(0, {core})
        return f"pinned to CPU core {core}"
    return "not pinned (no sched_setaffinity here)"


def time_search(model: str, cluster: str, seq_len: int, global_batch: int, measured: bool = False) -> float:
    train = TrainSpec(seq_len=seq_len, global_batch=global_batch, dtype="bf16")
    result = search(PRESETS[model], calibrated(cluster) if measured else parse_cluster(cluster), train)
    cluster += " (measured curves)" if measured else ""
    best = result.candidates[0]
    print(f"search {model} on {cluster} ({best.estimate.world_size} GPUs), seq {seq_len}, batch {global_batch}: "
          f"{result.seconds:.2f} s, {result.examined:,} candidates examined ({result.costed:,} costed in full), "
          f"{result.candidates_per_s:,.0f} candidates/s")
    print(f"  best: {best.plan.describe()}  step {best.estimate.step_time_s:.2f} s  MFU {best.estimate.mfu:.1%}  "
          f"{best.estimate.memory.total / 2**30:.1f} GiB/GPU")
    return result.seconds


def time_estimate(label: str, plan: Plan, repeats: int = 200) -> float:
    estimate(plan)  # fill the per-layer cache, as a planner or a second call would
    cold = []
    for _ in range(repeats):
        started = time.perf_counter()
        estimate(plan)
        cold.append(time.perf_counter() - started)
    median = statistics.median(cold)
    print(f"estimate {label:<58} {median * 1e6:7.0f} us  ({len(plan.layers_per_stage)} stages)")
    return median


def main() -> int:
    print(pin_to_one_core())
    seconds = time_search("gpt-1t", "384x8xA100-80GB", 2048, 3072)
    again = time_search("gpt-1t", "384x8xA100-80GB", 2048, 3072)
    time_search("llama3-405b", "64x8xH100-SXM", 8192, 1024)
    time_search("llama3-70b", "8x8xH100-SXM", 8192, 256)
    time_search("llama3-70b", "8x8xH100-SXM", 8192, 256, measured=True)
    train = TrainSpec(seq_len=2048, global_batch=3072)
    big = parse_cluster("384x8xA100-80GB")
    worst = max(
        time_estimate("llama3-8b dp4 tp2 on 1x8xH100-SXM", Plan(
            model=PRESETS["llama3-8b"], cluster=parse_cluster("1x8xH100-SXM"),
            train=TrainSpec(seq_len=8192, global_batch=32), dp=4, tp=2, sequence_parallel=True, zero=1)),
        time_estimate("llama3-8b dp4 tp2 zero3, measured curves", Plan(
            model=PRESETS["llama3-8b"], cluster=calibrated("1x8xH100-SXM"),
            train=TrainSpec(seq_len=8192, global_batch=32), dp=4, tp=2, sequence_parallel=True, zero=3)),
        time_estimate("gpt3-175b dp8 tp8 pp8 interleaved(v2) on 64x8xA100-80GB", Plan(
            model=PRESETS["gpt3-175b"], cluster=parse_cluster("64x8xA100-80GB"),
            train=TrainSpec(seq_len=2048, global_batch=1536), dp=8, tp=8, pp=8, schedule="interleaved-1f1b",
            virtual_stages=2, sequence_parallel=True, zero=1)),
        time_estimate("gpt-1t dp6 tp8 pp64 1f1b on 384x8xA100-80GB", Plan(
            model=PRESETS["gpt-1t"], cluster=big, train=train, dp=6, tp=8, pp=64, sequence_parallel=True)),
        time_estimate("gpt-1t dp6 tp8 pp64 interleaved(v2) on 384x8xA100-80GB", Plan(
            model=PRESETS["gpt-1t"], cluster=big, train=train, dp=6, tp=8, pp=64, schedule="interleaved-1f1b",
            virtual_stages=2, sequence_parallel=True)),
    )
    print(f"targets: one estimate < 1 ms: {'met' if worst < 1e-3 else 'MISSED'} (worst {worst * 1e3:.2f} ms); "
          f"1T search on 3072 GPUs < 2 s: {'met' if seconds < 2 else 'MISSED'} ({seconds:.2f} s cold, "
          f"{again:.2f} s warm)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
