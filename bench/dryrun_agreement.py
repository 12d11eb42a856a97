"""Dry run vs cost model at full scale (docs/validation.md, "Dry run"): Llama 3 8B FSDP on 8 H100, 8B tp2 x pp2 x
dp4 on 16, 70B tp8 x pp4 x dp2 on 64, sequence 8192, selective recompute, bf16 (the runtime's GPU configuration
on fake tensors). Prints per kind of rank the measured and estimated peak, the signed error, the wall and CPU
seconds and the machine's load (the machine is shared; CPU seconds are what the load does not stretch).

    PYTHONPATH=src python bench/dryrun_agreement.py [--only NAME]
"""

from __future__ import annotations

import argparse
import os
import time

from fivefold.dryrun.run import GIB, dry_run
from fivefold.flags import plan_from_args

PLANS = {
    "llama3-8b fsdp8": "--model llama3-8b --cluster 1x8xH100-SXM --zero 3",
    "llama3-8b tp2 pp2 dp4": "--model llama3-8b --cluster 2x8xH100-SXM --tp 2 --pp 2 --dp 4 --zero 1 "
                             "--global-batch 32",
    "llama3-70b tp8 pp4 dp2": "--model llama3-70b --cluster 8x8xH100-SXM --tp 8 --pp 4 --dp 2 --zero 1 "
                              "--global-batch 16",
}
COMMON = "--seq-len 8192 --recompute selective"


def main() -> None:
    from fivefold.cli import build_parser

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="run only the plan whose name contains this")
    args = parser.parse_args()
    for name, flags in PLANS.items():
        if args.only and args.only not in name:
            continue
        if "--global-batch" not in flags:
            flags += " --global-batch 8"
        plan = plan_from_args(build_parser().parse_args(["dryrun", *f"{flags} {COMMON}".split()]))
        load = os.getloadavg()[0]
        started = time.perf_counter()
        result = dry_run(plan, "cuda")
        wall = time.perf_counter() - started
        cpu = sum(r.cpu_seconds for r in result.ranks)
        print(f"{name}: {result.describe}; {wall:.0f} s wall, {cpu:.0f} s CPU in the rank workers, "
              f"load {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        for r in result.ranks:
            print(f"  rank {r.rank:>3} pp {r.pp_stage}: measured {r.measured['peak'] / GIB:6.2f} GiB, estimated "
                  f"{r.estimated['peak'] / GIB:6.2f} GiB, error {r.error:+.1%} ({r.micro_batches} micro-batches, "
                  f"{r.seconds:.0f} s wall, {r.cpu_seconds:.0f} s CPU)")


if __name__ == "__main__":
    main()
