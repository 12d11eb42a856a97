"""How long training is blocked by an asynchronous checkpoint save versus a synchronous one, side by side.

One process trains the same model three times in a row, so the runs share the machine's state: without
checkpoints, with synchronous saves (training waits until the files, manifest and COMMIT are written)
and with asynchronous saves (training waits only while its state is copied to CPU memory; a background
thread writes and commits). Printed per save (median): the time training was blocked, the part of it
spent waiting for the previous save (at most one is in flight, so saves closer together than one write
wait), and the time until the checkpoint was committed; per run: the mean step time (with async saves
the background writer competes with training for the same cores) and the wall time. Steps are kept
cheap (a short batch): the point is the save. On a shared machine whole runs slow down with the
neighbours' load; the blocked time per save is the robust number.

    .venv/bin/python bench/checkpoint_speed.py [--model layers=8,hidden=1024,heads=16,vocab=8192] [--every 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fivefold.runtime import RunConfig, train
from fivefold.runtime.launch import free_port
from fivefold.spec import Plan, TrainSpec, parse_cluster, parse_model


def run(plan: Plan, steps: int, every: int, checkpoint_dir: str | None, asynchronous: bool) -> dict:
    start = time.perf_counter()
    summary = train(RunConfig(plan.to_toml(), steps=steps, seed=0, device="cpu", show_progress=False,
                              checkpoint_dir=checkpoint_dir, checkpoint_every=every, keep=1,
                              checkpoint_async=asynchronous))
    return {**summary, "wall_s": time.perf_counter() - start}


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="layers=8,hidden=1024,heads=16,vocab=8192",
                        help="~118M parameters: 0.47 GB of fp32 weights, 1.4 GB with the AdamW state")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10,
                        help="save every K steps (and after the last); far enough apart for one write")
    args = parser.parse_args()

    # A world of one process: what torchrun would set for `--nproc-per-node 1`.
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    plan = Plan(model=parse_model(args.model), cluster=parse_cluster("1x1xcpu"),
                train=TrainSpec(seq_len=args.seq_len, global_batch=args.global_batch, dtype="fp32"),
                micro_batch=args.global_batch)
    print(f"model {plan.model.num_params() / 1e6:.0f}M parameters ({plan.model.num_params() * 4 / 1e9:.2f} GB fp32), "
          f"{args.steps} steps, a save every {args.every} steps and after the last; "
          f"{os.cpu_count()} CPU cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["no saves"] = run(plan, args.steps, args.every, None, True)
        for name, asynchronous in (("sync saves", False), ("async saves", True)):
            folder = Path(tmp) / name.replace(" ", "-")
            results[name] = run(plan, args.steps, args.every, str(folder), asynchronous)
            results[name]["bytes"] = folder_bytes(folder)

    print(f"\n{'':<12} {'blocked':>10} {'waiting for previous':>21} {'until COMMIT':>13} {'mean step':>10} "
          f"{'run wall time':>14}   (per save: medians)")
    for name, result in results.items():
        seconds = result["checkpoint_seconds"]
        per_save = [f"{statistics.median(seconds[key]):.3f} s" if seconds[key] else "-"
                    for key in ("blocked", "waiting", "until_commit")]
        print(f"{name:<12} {per_save[0]:>10} {per_save[1]:>21} {per_save[2]:>13} "
              f"{result['mean_step_time_s']:>8.3f} s {result['wall_s']:>12.1f} s")
    sync_blocked = statistics.median(results["sync saves"]["checkpoint_seconds"]["blocked"])
    async_blocked = statistics.median(results["async saves"]["checkpoint_seconds"]["blocked"])
    print(f"\ncheckpoint size {results['async saves']['bytes'] / 1e9:.2f} GB; per save, training is blocked "
          f"{sync_blocked / async_blocked:.1f}x less with async saves ({async_blocked:.3f} s vs {sync_blocked:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
