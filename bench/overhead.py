"""fivefold's step time against the plain PyTorch script each parallelism replaces, side by side.

One row per parallelism, each against what a user would otherwise write by hand with the same torch pieces,
on the same model (fivefold.models), the same seeded weights and the same batches:

    1 process   a plain loop: forward, cross-entropy, backward, clip_grad_norm_, AdamW (nanoGPT style)
    dp2         DistributedDataParallel, each rank its half of the batch
    zero3       fully_shard on every block and the root (FSDP2), SUM reductions (gloo has no AVG)
    tp2         parallelize_module: q/k/v and w1/w3 column-wise, wo and w2 row-wise, the embedding by
                vocabulary rows, the head column-wise (fivefold's plan without sequence parallel)
    pp2         torch.distributed.pipelining: the model cut in two stages, Schedule1F1B over 4
                micro-batches, clipping by the norm summed over both stages (as TorchTitan does)
    compile     (1 process) fivefold --compile against fivefold eager: the speed-up, not an overhead

Both sides run in the same worker processes (one launch per world size), alternating within each round
(plain first in even rounds, fivefold first in odd ones); each run trains a fresh model for --steps steps and
keeps the median step time of rank 0 after --warmup steps. The ratio column is the median over rounds of
fivefold / plain; the last column divides the fastest step of all fivefold runs by the fastest plain one, which
a busy neighbour on a shared machine disturbs least. Every rank uses one thread (OMP_NUM_THREADS=1): two threads per process on a shared 2-core
machine collapse whenever a neighbour wants a core. Target: every ratio <= 1.05.

    .venv/bin/python bench/overhead.py [--model small] [--seq-len 128] [--global-batch 16] [--rounds 3]
                                       [--only dp2,zero3] [--markdown]
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

# name -> (processes, fivefold plan fields); "compile" compares fivefold --compile with fivefold eager.
ROWS: dict[str, tuple[int, dict]] = {
    "1 process": (1, dict()),
    "compile": (1, dict()),
    "dp2": (2, dict(dp=2)),
    "zero3": (2, dict(dp=2, zero=3)),
    "tp2": (2, dict(tp=2)),
    "pp2": (2, dict(pp=2, schedule="1f1b", micro_batch=4)),
}
LR = 1e-3


def make_plan(args: argparse.Namespace, row: str):
    from fivefold.spec import Plan, TrainSpec, parse_cluster, parse_model

    world, fields = ROWS[row]
    fields = dict(fields)
    # One micro-batch per replica, as the plain scripts run (pp: the schedule's micro-batches).
    fields.setdefault("micro_batch", args.global_batch // fields.get("dp", 1))
    return Plan(model=parse_model(args.model), cluster=parse_cluster(f"1x{world}xcpu"),
                train=TrainSpec(seq_len=args.seq_len, global_batch=args.global_batch, dtype="fp32"), **fields)


# --- the plain scripts ------------------------------------------------------------------------------

def _tensor_parallel_by_hand(model, mesh) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                                     "output": ColwiseParallel(output_layouts=Replicate())})
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()})


def _clip_tensor_parallel(params: list, max_norm: float) -> None:
    """clip_grad_norm_ refuses a mix of DTensor (sharded weights) and plain (norm weights) gradients: the
    sharded squares are summed over the tp ranks in one all-reduce, the replicated ones counted once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sharded = [p.grad.to_local() for p in params if isinstance(p.grad, DTensor)]
    replicated = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    squared = torch.stack(torch._foreach_norm(sharded)).pow(2).sum()
    dist.all_reduce(squared)
    squared += torch.stack(torch._foreach_norm(replicated)).pow(2).sum()
    torch.nn.utils.clip_grads_with_norm_(sharded + replicated, max_norm, squared.sqrt())


def plain_step_times(row: str, plan, steps: int, seed: int) -> list[float]:
    """Per-step seconds of the hand-written script for `row` (module docstring), on this rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from fivefold.data import GlobalBatchLoader, default_dataset
    from fivefold.models import build_model, init_weights

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(plan.model, device="meta")
    if row == "pp2":  # keep this rank's half of the layers, and the embedding or the head
        half = plan.model.layers // 2
        for key in list(model.layers.keys()):
            if (int(key) < half) != (rank == 0):
                del model.layers[key]
        if rank == 0:
            model.norm = model.output = None
        else:
            model.tok_embeddings = None
    elif row == "tp2":
        _tensor_parallel_by_hand(model, init_device_mesh("cpu", (world,)))
    elif row == "zero3":
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG
    model.to_empty(device="cpu")
    init_weights(model, seed)
    params = list(model.parameters())
    if row == "dp2":
        model = torch.nn.parallel.DistributedDataParallel(model)
    decay, no_decay = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.95))
    schedule = None
    if row == "pp2":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        def loss_fn(logits, targets):
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=plan.train.global_batch // plan.micro_batch, loss_fn=loss_fn)
    loader = GlobalBatchLoader(default_dataset(), plan.train.seq_len, plan.train.global_batch, seed)
    share = plan.train.global_batch // world
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        batch = loader.next_batch()
        if row in ("dp2", "zero3"):
            batch = batch[rank * share:(rank + 1) * share]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if schedule is None:
            loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
            loss.backward()
            if row == "tp2":
                _clip_tensor_parallel(params, 1.0)
            else:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            losses: list = []
            if rank == 0:
                schedule.step(inputs)
            else:
                schedule.step(target=targets, losses=losses)
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            squared = norm ** 2
            dist.all_reduce(squared)
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, squared.sqrt())
            loss = torch.stack(losses).sum() if losses else torch.zeros(())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
    return times


def fivefold_step_times(plan, steps: int, seed: int, metrics_file: str, compile_blocks: bool = False) -> list[float]:
    """Per-step seconds of `fivefold train` for `plan` (rank 0's metrics file; other ranks get [])."""
    import dataclasses

    import torch.distributed as dist

    from fivefold.runtime import RunConfig
    from fivefold.runtime.train import train

    config = RunConfig(plan.to_toml(), steps=steps, seed=seed, lr=LR, device="cpu", show_progress=False,
                       metrics_file=metrics_file)
    if compile_blocks:
        config = dataclasses.replace(config, compile=True)
    train(config)
    if dist.get_rank() != 0:
        return []
    return [json.loads(line)["step_time_s"] for line in Path(metrics_file).read_text().splitlines()]


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
            runs = {}
            order = ("plain", "fivefold") if job["round"] % 2 == 0 else ("fivefold", "plain")
            for side in order:
                dist.barrier()
                if job["row"] == "compile":
                    runs[side] = fivefold_step_times(plan, job["steps"], job["round"], job["metrics"] + side,
                                                     compile_blocks=side == "fivefold")
                elif side == "plain":
                    runs[side] = plain_step_times(job["row"], plan, job["steps"], job["round"])
                else:
                    runs[side] = fivefold_step_times(plan, job["steps"], job["round"], job["metrics"])
            out.append({**job, **{side: statistics.median(times[job["warmup"]:]) for side, times in runs.items()
                                  if times},
                        **{f"{side}_min": min(times[job["warmup"]:]) for side, times in runs.items() if times}})
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
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
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
              "ratio of fastest steps")]
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
                      f"{min(r['fivefold_min'] for r in mine) / min(r['plain_min'] for r in mine):.3f}"))
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
