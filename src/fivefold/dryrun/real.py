"""The same step on real tensors in a real gloo world: what a dry run is checked against.

`measure_real(plan)` starts the plan's world as CPU processes (torch.multiprocessing, gloo), builds every
rank with dryrun/rank.py's code on real tensors (p2p moves real activations, the clip reads the true
norm) and returns the accounted peak of each pp rank's representative rank. Only the fake world
and the fake tensors differ from `fivefold dryrun`, so the two peaks must agree.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fivefold.dryrun.rank import Accounted, build_and_step
from fivefold.spec import Plan


def _worker(rank: int, plan: Plan, port: int, wanted: list[int], results: dict) -> None:
    from fivefold.runtime.mesh import build_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(plan.world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=plan.world_size)
    try:
        mesh = build_mesh(plan, torch.device("cpu"))
        accounted = build_and_step(plan, mesh, None, seed=0, started=time.perf_counter(), fake=False)
        if rank in wanted:
            results[rank] = accounted
    finally:
        dist.destroy_process_group()


def measure_real(plan: Plan, ranks: list[int]) -> dict[int, Accounted]:
    """Accounted peaks of `ranks` from a real run of one step of `plan` in fp32 on CPU processes."""
    from fivefold.runtime.launch import free_port

    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(plan, free_port(), ranks, results), nprocs=plan.world_size,
                           start_method="spawn")
        return dict(results)
