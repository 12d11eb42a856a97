"""Collective and point-to-point bandwidth and latency over the local process group.

Each worker process joins a gloo (CPU) or NCCL (GPU) group; rank 0 reports the median time per message
size. Bus bandwidth follows the nccl-tests convention (algorithm bandwidth x 2(n-1)/n for all-reduce,
(n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for send/recv) so that one number describes the
link whatever the collective.
"""

from __future__ import annotations

import os
import queue
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fivefold.profile.kernels import median_seconds

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class CollectivePoint:
    collective: str  # one of COLLECTIVES
    ranks: int  # group size
    message_bytes: int  # bytes each rank contributes (all-gather: its shard; send/recv: the message)
    seconds: float  # median time of one call
    bus_bandwidth: float  # bytes/s, nccl-tests convention


def bus_factor(collective: str, ranks: int) -> float:
    if collective == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if collective == "send_recv":
        return 1.0
    return (ranks - 1) / ranks


def message_sizes(quick: bool) -> list[int]:
    top = 22 if quick else 26  # 4 MiB or 64 MiB
    return [2**p for p in range(12, top + 1, 2)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _one_call(collective: str, rank: int, ranks: int, message_bytes: int, device: torch.device):
    elements = max(ranks, message_bytes // 4 // ranks * ranks)
    data = torch.ones(elements, device=device)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(data)
    if collective == "all_gather":
        gathered = torch.empty(elements * ranks, device=device)
        return lambda: dist.all_gather_single(gathered, data)
    if collective == "reduce_scatter":
        shard = torch.empty(elements // ranks, device=device)
        return lambda: dist.reduce_scatter_single(shard, data)
    if collective == "all_to_all":
        received = torch.empty_like(data)
        return lambda: dist.all_to_all_single(received, data)
    # send/recv ping-pong between ranks 0 and 1; a round trip is two messages.
    def ping_pong():
        if rank == 0:
            dist.send(data, 1)
            dist.recv(data, 1)
        elif rank == 1:
            dist.recv(data, 0)
            dist.send(data, 0)
    return ping_pong


def _agree_with_rank0(count: int, device: torch.device) -> int:
    """Rank 0's loop count, so every rank makes the same number of collective calls."""
    agreed = torch.tensor([count], device=device)
    dist.broadcast(agreed, 0)
    return int(agreed.item())


def _worker(rank: int, ranks: int, port: int, quick: bool, use_cuda: bool, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=ranks)
    try:
        for collective in COLLECTIVES:
            for size in message_sizes(quick):
                call = _one_call(collective, rank, ranks, size, device)
                seconds = median_seconds(call, device, repeats=3 if quick else 7, min_seconds=0.01 if quick else 0.05,
                                         agree=lambda count: _agree_with_rank0(count, device),
                                         before_sample=dist.barrier)
                if collective == "send_recv":
                    seconds /= 2
                if rank == 0:
                    bandwidth = size * bus_factor(collective, ranks) / seconds
                    results.put(CollectivePoint(collective, ranks, size, seconds, bandwidth))
    finally:
        dist.destroy_process_group()
        if rank == 0:
            results.put(None)


def measure_collectives(ranks: int, quick: bool, use_cuda: bool, on_point=None) -> list[CollectivePoint]:
    """Spawn `ranks` local processes and time every collective over every message size."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_worker, args=(r, ranks, port, quick, use_cuda, results), daemon=True)
                 for r in range(ranks)]
    for process in processes:
        process.start()
    points = []
    while True:
        try:
            point = results.get(timeout=2)
        except queue.Empty:
            dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if dead:
                for process in processes:
                    process.kill()
                raise RuntimeError(f"a collective-measurement process failed (exit codes {dead})") from None
            continue
        if point is None:
            break
        points.append(point)
        if on_point:
            on_point(point)
    for process in processes:
        process.join(timeout=60)
    failed = [p.exitcode for p in processes if p.exitcode not in (0, None)]
    if failed:
        raise RuntimeError(f"a collective-measurement process failed (exit codes {failed})")
    return points
