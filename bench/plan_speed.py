"""Speed of the cost model and the planner, on one CPU core.

    .venv/bin/python bench/plan_speed.py

Targets (issue 3): estimating one plan under 1 ms; a full search for the 1T-parameter GPT (preset gpt-1t)
on 3072 GPUs under 2 s. The search runs first, in this fresh process, so its caches start cold.
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


def pin_to_one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        core = sorted(os.sched_getaffinity(0))[0]
        os.sched_setaffinity(0, {core})
        return f"pinned to CPU core {core}"
    return "not pinned (no sched_setaffinity here)"


def time_search(model: str, cluster: str, seq_len: int, global_batch: int) -> None:
    train = TrainSpec(seq_len=seq_len, global_batch=global_batch, dtype="bf16")
    result = search(PRESETS[model], parse_cluster(cluster), train)
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
    train = TrainSpec(seq_len=2048, global_batch=3072)
    big = parse_cluster("384x8xA100-80GB")
    worst = max(
        time_estimate("llama3-8b dp4 tp2 on 1x8xH100-SXM", Plan(
            model=PRESETS["llama3-8b"], cluster=parse_cluster("1x8xH100-SXM"),
            train=TrainSpec(seq_len=8192, global_batch=32), dp=4, tp=2, sequence_parallel=True, zero=1)),
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
