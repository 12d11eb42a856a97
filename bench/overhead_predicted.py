"""bench/overhead.py's plans (one per parallelism, the plain scripts' shapes), trained by `fivefold train`'s
launcher and predicted by the cost model's `fivefold` stack from this machine's profile: the closed loop of
bench/closed_loop.py on exactly the plans the runtime-efficiency table compares.

    .venv/bin/python bench/overhead_predicted.py [--repeats 3] [--out-dir out/overhead_predicted]
                                                 [--reuse-profiles]

Per process count (1, then 2): `fivefold profile` with that many ranks, one thread each (as the closed loop);
then each repeat trains every row's plan 8 steps in one launch. Measured: the report's step time (median after
the 2 warm-up steps), then the median over the repeats; predicted: the report's figure for the plan on the
profiled cluster (for ep > 1 with the routing imbalance the run measured). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from closed_loop import STACK, load_average, profile_files, train_plans  # noqa: E402
from overhead import ROWS, add_shape_arguments, make_plan  # noqa: E402

from fivefold.report import build_report, load_run  # noqa: E402
from fivefold.spec import parse_cluster  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first 2 are warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="launches per process count; measured = their median")
    parser.add_argument("--out-dir", default="out/overhead_predicted", help="profiles and run folders")
    parser.add_argument("--reuse-profiles", action="store_true", help="keep profile-N.toml files already there")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank, for the profile and the runs alike
    folder = Path(args.out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [row for row in ROWS if row != "compile"]
    predicted: dict[str, float] = {}
    measured: dict[str, list[float]] = {row: [] for row in rows}
    print(f"load average before: {load_average()}", flush=True)
    for procs in sorted({ROWS[row][0] for row in rows}):
        profile = profile_files([procs], folder, reuse=args.reuse_profiles, quick=False)[procs]
        names = [row for row in rows if ROWS[row][0] == procs]
        plans = [dataclasses.replace(make_plan(args, row), cluster=parse_cluster(str(profile))) for row in names]
        for repeat in range(args.repeats):
            runs = train_plans(plans, folder / f"{procs}-r{repeat}", args.steps, trace=False)
            for row, run in zip(names, runs):
                step = build_report(load_run(run), STACK)[0].figures[0]
                predicted[row] = step.predicted
                if step.measured:
                    measured[row].append(step.measured)
        print(f"{procs} process(es) done (load average: {load_average()})", flush=True)
    print("\n| row | predicted | measured | error | measured range |\n|---|---|---|---|---|")
    for row in rows:
        times = measured[row]
        middle = statistics.median(times)
        print(f"| {row} | {predicted[row] * 1e3:.1f} ms | {middle * 1e3:.1f} ms | "
              f"{100 * (predicted[row] / middle - 1):+.1f}% | {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
