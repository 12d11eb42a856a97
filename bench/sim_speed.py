"""Speed of the simulator at scale, before and after the event-driven engine, side by side in one run.

    flock /tmp/fivefold-heavy.lock .venv/bin/python bench/sim_speed.py [--before COMMIT] [--plan-before]

What it times, each as its own `python -m fivefold ...` process (start-up, imports, PNG and trace included):
1. `fivefold simulate` of the 1T GPT (preset gpt-1t) on 3,072 A100 (384x8xA100-80GB), tp8 pp64 dp6,
   interleaved-1f1b v2, 512 micro-batches: 131,072 actions, ~260,000 timeline events. Target: under 3 s.
2. `fivefold plan --top 10 --simulate-top 10` for the same model and cluster. Target: under 20 s. The
   "before" column of this one takes minutes; it runs only with --plan-before.

"Before" is the source tree of COMMIT (default: main just before issue #18's simulator work), unpacked
with `git archive` into a temporary folder and run from there; "after" is this checkout. Wall seconds
depend on what else the machine runs, so the load average is printed with them, and CPU seconds (user +
system of the child) beside them. Issue #18's "how to read it" is in docs/simulate.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "3302110"  # main before issue #18: the polling engine, one bar per action in the picture
SIMULATE = ["simulate", "--model", "gpt-1t", "--cluster", "384x8xA100-80GB", "--tp", "8", "--pp", "64", "--dp", "6",
            "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--global-batch", "3072", "--seq-len", "2048"]
PLAN = ["plan", "--model", "gpt-1t", "--cluster", "384x8xA100-80GB", "--global-batch", "3072", "--seq-len", "2048",
        "--top", "10", "--simulate-top", "10"]


def unpack(commit: str, into: Path) -> Path:
    """The src/ tree of `commit`, extracted under `into`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], check=True,
                             capture_output=True).stdout
    with tempfile.TemporaryFile() as handle:
        handle.write(archive)
        handle.seek(0)
        with tarfile.open(fileobj=handle) as tar:
            tar.extractall(into, filter="data")
    return into / "src"


def timed(source: Path, args: list[str], out_dir: Path | None) -> tuple[float, float]:
    """(wall, CPU) seconds of one `python -m fivefold ARGS` run on the sources under `source`."""
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "fivefold", *args] + (["--out-dir", str(out_dir)] if out_dir else [])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def best_of(runs: int, source: Path, args: list[str], out_dir: Path | None) -> tuple[float, float]:
    """The run with the least wall time of `runs` (the machine is shared: the least disturbed one)."""
    return min((timed(source, args, out_dir) for _ in range(runs)), key=lambda pair: pair[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help="commit whose src/ is 'before' (default %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each 'after' command; the fastest counts")
    parser.add_argument("--plan-before", action="store_true", help="also time plan --simulate-top 10 before (minutes)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        old = unpack(args.before, Path(tmp) / "before")
        new = ROOT / "src"
        rows: list[tuple[str, tuple[float, float] | None, tuple[float, float], float]] = [
            ("simulate 1T, 3,072 A100 (PNG + trace)", best_of(1, old, SIMULATE, Path(tmp) / "sim-before"),
             best_of(args.runs, new, SIMULATE, Path(tmp) / "sim-after"), 3.0)]
        plan_before = best_of(1, old, PLAN, None) if args.plan_before else None
        rows.append(("plan --simulate-top 10, same", plan_before, best_of(args.runs, new, PLAN, None), 20.0))
        sizes = {name: (Path(tmp) / "sim-after" / name).stat().st_size for name in ("trace.json", "timeline.png")}
    load = max(load, os.getloadavg()[0])
    print(f"{'':40} {'before (wall / CPU)':>22} {'after (wall / CPU)':>22} {'speed-up':>9} {'target':>8}")
    for name, before, after, target in rows:
        before_text = f"{before[0]:.2f} s / {before[1]:.2f} s" if before else "(--plan-before)"
        ratio = f"{before[0] / after[0]:.1f}x" if before else ""
        verdict = "ok" if after[0] < target else "MISSED"
        print(f"{name:40} {before_text:>22} {after[0]:>10.2f} s / {after[1]:.2f} s {ratio:>9} "
              f"{f'< {target:g} s':>8} {verdict}")
    print(f"before = {args.before}, after = this checkout; best of 1 before, {args.runs} after; load average "
          f"(1 min) up to {load:.1f} on {os.cpu_count()} CPUs; trace {sizes['trace.json'] / 2**20:.0f} MiB, "
          f"picture {sizes['timeline.png'] / 2**10:.0f} KiB")


if __name__ == "__main__":
    main()
