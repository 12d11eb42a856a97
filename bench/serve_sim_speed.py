"""Speed of `simulate --serve`: 10,000 requests through the scheduler with predicted step times (target <= 5 s).

Prints wall and CPU seconds: on the shared 2-core machine the wall time grows with the other jobs' load.

Usage: python bench/serve_sim_speed.py [--requests N]
"""

from __future__ import annotations

import argparse
import time

from fivefold.cost.deployment import place
from fivefold.sim.serving import simulate_serving
from fivefold.spec import PRESETS, parse_cluster
from fivefold.spec.serve import BatchLimits, ServeLayout
from fivefold.spec.workload import Workload, parse_length

CASES = [  # (label, cluster, layout, workload)
    ("llama3-70b 8xH100 tp8, 5 req/s", "1x8xH100-SXM", ServeLayout(tp=8),
     Workload(parse_length("1024:512", ""), parse_length("256:128", ""), rate=5.0)),
    ("llama3-70b 8xH100 tp4 x2 replicas, 20 req/s", "1x8xH100-SXM", ServeLayout(tp=4, replicas=2),
     Workload(parse_length("1024:512", ""), parse_length("256:128", ""), rate=20.0)),
    ("llama3-8b 8xH100 tp1 pp2 x4, inf", "1x8xH100-SXM", ServeLayout(pp=2, replicas=4),
     Workload(parse_length("512", ""), parse_length("128", ""), rate=float("inf"))),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    args = parser.parse_args()
    for label, cluster, layout, workload in CASES:
        model = PRESETS["llama3-70b" if "70b" in label else "llama3-8b"]
        workload = Workload(workload.prompt_len, workload.output_len, rate=workload.rate, num_requests=args.requests)
        replicas = place(model, parse_cluster(cluster), layout)
        start, cpu = time.perf_counter(), time.process_time()
        result = simulate_serving(replicas, BatchLimits(), workload, layout.pp)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        summary = result.to_dict()
        print(f"{label}: {args.requests} requests, {summary['steps']} steps in {seconds:.2f} s wall, {cpu:.2f} s CPU "
              f"(TTFT p90 {summary['ttft_s']['p90'] * 1e3:.0f} ms, TPOT p90 {summary['tpot_s']['p90'] * 1e3:.1f} ms, "
              f"{summary['output_tokens_per_s']:.0f} tok/s, {summary['preemptions']} preemptions)")


if __name__ == "__main__":
    main()
