"""Speed of `plan --serve`: the full search for Llama 3 70B on 8x8 H100 (target <= 1 s), and the smaller ones
the docs show.

Usage: python bench/serve_plan_speed.py
"""

from __future__ import annotations

import time

from fivefold.planner.serving import search_serving
from fivefold.spec import PRESETS, parse_cluster
from fivefold.spec.workload import Workload, parse_length

CASES = [
    ("llama3-70b", "8x8xH100-SXM", Workload(parse_length("1024:512", ""), parse_length("256:128", ""), rate=5.0,
                                            ttft_slo=2.0, tpot_slo=0.05)),
    ("llama3-70b", "8x8xH100-SXM", Workload(parse_length("1024:512", ""), parse_length("256:128", ""))),
    ("llama3-70b", "1x8xH100-SXM", Workload(parse_length("1024:512", ""), parse_length("256:128", ""), rate=5.0,
                                            ttft_slo=2.0, tpot_slo=0.05)),
    ("mixtral-8x7b", "2x8xH100-SXM+2x8xA100-80GB", Workload(rate=10.0, ttft_slo=1.0, tpot_slo=0.05)),
]


def main() -> None:
    for model, cluster, workload in CASES:
        spec, nodes = PRESETS[model], parse_cluster(cluster)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            candidates = search_serving(spec, nodes, workload, "bf16", "bf16", {})
            best = min(best, time.perf_counter() - start)
        top = candidates[0].layout
        print(f"{model} on {cluster} ({workload.describe()}): {len(candidates)} layouts in {best:.3f} s (best of 3);"
              f" winner tp={top.tp} pp={top.pp} replicas={top.replicas}")


if __name__ == "__main__":
    main()
