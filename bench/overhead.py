"""fivefold's step time against the plain PyTorch script each parallelism replaces, side by side.

One row per parallelism, each against what a user would otherwise write by hand with the same torch pieces
(bench/plain_scripts.py says what each script does), on the same model (fivefold.models), the same seeded
weights and the same batches: 1 process, dp2 (DDP), zero3 (fully_shard), tp2 (parallelize_module), pp2
(Schedule1F1B over 4 micro-batches), cp2 (K/V all-gather by hand; seq 512, global batch 4, the same tokens per
step as the others), ep2 (all_to_all_single dispatch by hand; an MoE version of the model, 8 experts top-2),
and compile: (1 process) fivefold --compile against fivefold eager, the speed-up, not an overhead.
Both sides train the same run (the same cosine schedule, clipping at norm 1): the table's last column is the
largest relative difference of their per-step losses over all rounds (target <= 1e-5).

Both sides run in the same worker processes (one launch per world size), alternating within each round
(plain first in even rounds, fivefold first in odd ones); each run trains a fresh model for --steps steps and
keeps the median step time of rank 0 after --warmup steps. The ratio column is the median over rounds of
fivefold / plain; the next column divides the fastest step of all fivefold runs by the fastest plain one, which
a busy neighbour on a shared machine disturbs least. Every rank uses one thread (OMP_NUM_THREADS=1): two
threads per process on a shared 2-core machine collapse whenever a neighbour wants a core. Target: every
ratio <= 1.05.

    .venv/bin/python bench/overhead.py [--model small] [--seq-len 128] [--global-batch 16] [--rounds 3]
                                       [--only dp2,zero3,cp2,ep2] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from plain_scripts import LR, plain_step_times  # noqa: E402  (the hand-written side of every row)

# name -> (processes, fivefold plan fields, train/model overrides); "compile" compares fivefold --compile with
# fivefold eager. cp2 trades batch for sequence (same tokens per step) so that attention is worth splitting.
MOE = "preset=small,experts=8,top_k=2,expert_ffn_hidden=344,aux_loss_coef=0.01"
ROWS: dict[str, tuple[int, dict, dict]] = {
    "1 process": (1, dict(), dict()),
    "compile": (1, dict(), dict()),
    "dp2": (2, dict(dp=2), dict()),
    "zero3": (2, dict(dp=2, zero=3), dict()),
    "tp2": (2, dict(tp=2), dict()),
    "pp2": (2, dict(pp=2, schedule="1f1b", micro_batch=4), dict()),
    "cp2": (2, dict(cp=2), dict(seq_len=512, global_batch=4)),
    "ep2": (2, dict(dp=2, ep=2), dict(model=MOE)),
}


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and batch every row is built from (make_plan reads them)."""
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)


def make_plan(args: argparse.Namespace, row: str):
    from fivefold.spec import Plan, TrainSpec, parse_cluster, parse_model

    world, fields, override = ROWS[row]
    fields = dict(fields)
    seq_len = args.seq_len * args.global_batch // override["global_batch"] if "global_batch" in override else \
        args.seq_len
    global_batch = override.get("global_batch", args.global_batch)
    # One micro-batch per replica, as the plain scripts run (pp: the schedule's micro-batches).
    fields.setdefault("micro_batch", global_batch // fields.get("dp", 1))
    return Plan(model=parse_model(override.get("model", args.model)), cluster=parse_cluster(f"1x{world}xcpu"),
                train=TrainSpec(seq_len=seq_len, global_batch=global_batch, dtype="fp32"), **fields)


def fivefold_step_times(plan, steps: int, seed: int, metrics_file: str, compile_blocks: bool = False
                        ) -> tuple[list[float], list[float]]:
    """Per-step seconds and losses of `fivefold train` for `plan` (rank 0's metrics file; other ranks get [])."""
    import dataclasses

    import torch.distributed as dist

    from fivefold.runtime import RunConfig
    from fivefold.runtime.train import train

    config = RunConfig(plan.to_toml(), steps=steps, seed=seed, lr=LR, warmup_steps=2, device="cpu",
                       show_progress=False, metrics_file=metrics_file)
    if compile_blocks:
        config = dataclasses.replace(config, compile=True)
    train(config)
    if dist.get_rank() != 0:
        return [], []
    records = [json.loads(line) for line in Path(metrics_file).read_text().splitlines()]
    return [r["step_time_s"] for r in records], [r["loss"] for r in records]


def bench_worker(jobs: list[dict]) -> list[dict]:
    """Runs in every worker process of one launch: each job's plain and fivefold runs, alternating."""
    import tomllib

    import torch
    import torch.distributed as dist

    from fivefold.runtime.mesh import init_distributed
    from fivefold.spec import plan_from_dict

    init_distributed(torch.device("cpu"), 600.0)
    out = []
    try:
        for job in jobs:
            plan = plan_from_dict(tomllib.loads(job["plan"]))
            runs, losses = {}, {}
            order = ("plain", "fivefold") if job["round"] % 2 == 0 else ("fivefold", "plain")
            for side in order:
                dist.barrier()
                if job["row"] == "compile":
                    runs[side], losses[side] = fivefold_step_times(
                        plan, job["steps"], job["round"], job["metrics"] + side, compile_blocks=side == "fivefold")
                elif side == "plain":
                    runs[side], losses[side] = plain_step_times(job["row"], plan, job["steps"], job["round"])
                else:
                    runs[side], losses[side] = fivefold_step_times(plan, job["steps"], job["round"], job["metrics"])
            if dist.get_rank() != 0:
                continue
            loss_gap = max(abs(a - b) / abs(b) for a, b in zip(losses["fivefold"], losses["plain"]))
            out.append({**job, **{side: statistics.median(times[job["warmup"]:]) for side, times in runs.items()},
                        **{f"{side}_min": min(times[job["warmup"]:]) for side, times in runs.items()},
                        "loss_gap": loss_gap})
    finally:
        dist.destroy_process_group()
    return out


def launch_jobs(jobs: list[dict], nproc: int) -> list[dict]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from fivefold.runtime.launch import free_port

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                          rdzv_endpoint=f"localhost:{free_port()}", run_id=f"overhead-{os.getpid()}",
                          max_restarts=0, monitor_interval=0.1, start_method="spawn")
    return elastic_launch(config, bench_worker)(jobs)[0]


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--steps", type=int, default=8, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(ROWS), help=f"rows to run, of {', '.join(ROWS)}")
    parser.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    import logging

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    rows = [r for r in args.only.split(",") if r]
    loads = [load_average()]
    results: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for nproc in sorted({ROWS[r][0] for r in rows}):
            jobs = [dict(row=row, round=index, plan=make_plan(args, row).to_toml(), steps=args.steps,
                         warmup=args.warmup, metrics=str(Path(folder) / f"{row.replace(' ', '_')}-{index}.jsonl"))
                    for index in range(args.rounds) for row in rows if ROWS[row][0] == nproc]
            results += launch_jobs(jobs, nproc)
            loads.append(load_average())
            print(json.dumps([{k: v for k, v in r.items() if k not in ("plan", "metrics")} for r in results]),
                  flush=True)  # the raw per-round medians, in case the table below fails
    minutes = (time.perf_counter() - started) / 60
    print(f"model {args.model}, seq {args.seq_len}, global batch {args.global_batch}, fp32, 1 thread per rank, "
          f"{args.rounds} rounds of {args.steps} steps ({args.warmup} warm-up); load average (1/5/15 min) "
          f"before / between / after: {' | '.join(loads)}; {minutes:.1f} min")
    table = [("parallelism", "plain PyTorch", "fivefold", "ratio (median of rounds)", "per round",
              "ratio of fastest steps", "loss gap")]
    worst = 0.0
    for row in rows:
        mine = [r for r in results if r["row"] == row]
        ratios = [r["fivefold"] / r["plain"] for r in mine]
        ratio = statistics.median(ratios)
        if row != "compile":
            worst = max(worst, ratio)
        plain_name = "fivefold eager" if row == "compile" else "plain"
        table.append((row if row != "compile" else "1 process --compile",
                      f"{statistics.median(r['plain'] for r in mine) * 1e3:.0f} ms ({plain_name})",
                      f"{statistics.median(r['fivefold'] for r in mine) * 1e3:.0f} ms", f"{ratio:.3f}",
                      " ".join(f"{x:.3f}" for x in ratios),
                      f"{min(r['fivefold_min'] for r in mine) / min(r['plain_min'] for r in mine):.3f}",
                      f"{max(r['loss_gap'] for r in mine):.1e}"))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)))
    if args.markdown:
        print("\n| " + " | ".join(table[0]) + " |\n|" + "---|" * len(table[0]))
        for line in table[1:]:
            print("| " + " | ".join(line) + " |")
    print(f"worst overhead ratio: {worst:.3f} (target <= 1.05)")
    return 0 if worst <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
