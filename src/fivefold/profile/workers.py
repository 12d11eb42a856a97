"""Measurements made by N local worker processes at once, the way `fivefold train` runs N ranks.

On CPU, N ranks share the machine's cores: a rank's GEMM rate, memory bandwidth and host costs are what
it gets while the other N-1 work too, with the intra-op threads the launcher gives each worker
(runtime/launch.py: OMP_NUM_THREADS when set, else cores // N). So every rank runs the same
measurement at the same time (a barrier before each), and rank 0 reports. On GPUs each rank has its own
device and only the collectives are measured here (run.py times the GEMMs on one GPU).
"""

from __future__ import annotations

import os
import queue
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fivefold.local import free_port, threads_per_worker, tune_allocator
from fivefold.profile.collectives import CollectivePoint, agree_with_rank0, measure_collectives_here
from fivefold.profile.kernels import GemmPoint, measure_gemm, measure_memory_bandwidth
from fivefold.spec.cluster import HostCosts

CPU_DTYPES = ["fp32", "bf16"]


@dataclass
class RankMeasurements:
    """What rank 0 measured while every rank measured the same."""

    ranks: int
    threads: int  # intra-op threads per rank (CPU)
    gemm: list[GemmPoint] = field(default_factory=list)
    memory_bandwidth: float = 0.0  # bytes/s, STREAM copy; 0 when not measured here
    host: HostCosts | None = None
    collectives: list[CollectivePoint] = field(default_factory=list)


def _worker(rank: int, ranks: int, port: int, quick: bool, use_cuda: bool, compute: bool, threads: int,
            results) -> None:
    from fivefold.interrupt import quiet_sigint_in_worker

    quiet_sigint_in_worker()  # Ctrl-C reaches the whole process group: end without a traceback
    tune_allocator()  # as a training worker (runtime/launch.py)
    from fivefold.runtime.mesh import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ranks))
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    init_distributed(device)  # the runtime's one process-group start (env://), as a training rank starts it

    def emit(kind: str, item: object) -> None:
        if rank == 0:
            results.put((kind, item))

    try:
        if compute and not use_cuda:
            from torch.distributed.device_mesh import init_device_mesh

            from fivefold.profile.host import measure_host_costs
            from fivefold.profile.serving import measure_serving_host

            # A 1-rank mesh per rank (DTensor and FSDP2 machinery without communication), all N ranks, and
            # pairs of ranks for 2-way tensor parallelism.
            grid = init_device_mesh("cpu", (ranks, 1), mesh_dim_names=("world", "alone"))
            pairs = init_device_mesh("cpu", (ranks // 2, 2), mesh_dim_names=("pairs", "pair"))["pair"] \
                if ranks % 2 == 0 else None
            agree = (lambda count: agree_with_rank0(count, device)) if ranks > 1 else (lambda count: count)

            def bandwidth() -> float:
                dist.barrier()
                return measure_memory_bandwidth(device, quick, line_up=dist.barrier, agree=agree)

            # The copy rate is timed three times over the profile and the median kept: a single reading of
            # two ranks copying at once here swung between 14 and 29 GB/s, where GEMM rates stay within 5%.
            copies = [bandwidth()]
            measure_gemm(device, CPU_DTYPES, quick, on_point=lambda p: emit("gemm", p), line_up=dist.barrier,
                         agree=agree)
            copies.append(bandwidth())
            host = measure_host_costs(grid["alone"], quick, grid["world"] if ranks > 1 else None, pairs,
                                      line_up=dist.barrier, agree=agree)
            # The serving engine's per-step host work, every rank at once (profile/serving.py).
            host = replace(host, **measure_serving_host(quick, line_up=dist.barrier))
            copies.append(bandwidth())
            emit("memory", statistics.median(copies))
            emit("host", host)
        if ranks > 1:
            dist.barrier()
            measure_collectives_here(rank, ranks, quick, device, lambda p: emit("collective", p))
    finally:
        dist.destroy_process_group()
        if rank == 0:
            results.put(None)


def measure_on_ranks(ranks: int, quick: bool, use_cuda: bool, compute: bool = True,
                     on_step: Callable[[str, object], None] | None = None) -> RankMeasurements:
    """Spawn `ranks` local processes; on CPU (with `compute`) time GEMMs, memory and host costs on all of
    them at once, then (ranks > 1) every collective. `on_step(kind, item)` sees each result as it comes."""
    threads = threads_per_worker(ranks) if not use_cuda else 1  # the launcher's rule
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(r, ranks, port, quick, use_cuda, compute, threads, results),
                                 daemon=True) for r in range(ranks)]
    for process in processes:
        process.start()
    try:
        return _collect(processes, results, RankMeasurements(ranks, threads), on_step)
    except BaseException:  # Ctrl-C, SIGTERM, a failed rank: no measurement process outlives the parent
        for process in processes:
            process.kill()
        for process in processes:
            process.join(timeout=10)
        raise


def _collect(processes: list, results, out: RankMeasurements,
             on_step: Callable[[str, object], None] | None) -> RankMeasurements:
    """What rank 0 reports, until it says it is done; then every process has to exit cleanly."""
    while True:
        try:
            item = results.get(timeout=2)
        except queue.Empty:
            dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if dead:
                for process in processes:
                    process.kill()
                raise RuntimeError(f"a measurement process failed (exit codes {dead})") from None
            continue
        if item is None:
            break
        kind, value = item
        if kind == "gemm":
            out.gemm.append(value)
        elif kind == "memory":
            out.memory_bandwidth = value
        elif kind == "host":
            out.host = value
        else:
            out.collectives.append(value)
        if on_step and kind != "host":  # the CLI's progress knows gemm, memory and collective steps
            on_step(kind, value)
    for process in processes:
        process.join(timeout=60)
    failed = [p.exitcode for p in processes if p.exitcode not in (0, None)]
    if failed:
        raise RuntimeError(f"a measurement process failed (exit codes {failed})")
    return out


def measure_collectives(ranks: int, quick: bool, use_cuda: bool, on_point=None) -> list[CollectivePoint]:
    """Spawn `ranks` local processes and time every collective over every message size."""
    return measure_on_ranks(ranks, quick, use_cuda, compute=False,
                            on_step=lambda kind, point: on_point(point) if on_point else None).collectives
