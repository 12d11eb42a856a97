"""Collective and point-to-point bandwidth and latency over the local process group.

Each worker process joins a gloo (CPU) or NCCL (GPU) group; rank 0 reports the median time per message
size. Bus bandwidth follows the nccl-tests convention (algorithm bandwidth x 2(n-1)/n for all-reduce,
(n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for send/recv) so that one number describes the
link whatever the collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from fivefold.profile.kernels import median_seconds

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
PAIR_COLLECTIVES = tuple(c for c in COLLECTIVES if c != "send_recv")  # send/recv pairs two ranks already


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


def _one_call(collective: str, rank: int, ranks: int, message_bytes: int, device: torch.device, group=None):
    elements = max(ranks, message_bytes // 4 // ranks * ranks)
    data = torch.ones(elements, device=device)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(data, group=group)
    if collective == "all_gather":
        gathered = torch.empty(elements * ranks, device=device)
        return lambda: dist.all_gather_single(gathered, data, group=group)
    if collective == "reduce_scatter":
        shard = torch.empty(elements // ranks, device=device)
        return lambda: dist.reduce_scatter_single(shard, data, group=group)
    if collective == "all_to_all":
        received = torch.empty_like(data)
        return lambda: dist.all_to_all_single(received, data, group=group)
    # send/recv ping-pong between ranks 0 and 1; a round trip is two messages.
    def ping_pong():
        if rank == 0:
            dist.send(data, 1)
            dist.recv(data, 1)
        elif rank == 1:
            dist.recv(data, 0)
            dist.send(data, 0)
    return ping_pong


def agree_with_rank0(count: int, device: torch.device) -> int:
    """Rank 0's loop count, so every rank makes the same number of collective calls."""
    agreed = torch.tensor([count], device=device)
    dist.broadcast(agreed, 0)
    return int(agreed.item())


def measure_collectives_here(rank: int, ranks: int, quick: bool, device: torch.device,
                             emit: Callable[[CollectivePoint], None]) -> None:
    """Time every collective over every message size in this process group (all ranks call this);
    rank 0 emits the points. With 4 or more ranks (an even count), the collectives again over pairs of
    ranks (0-1, 2-3, ...), every pair at once: a plan's 2-way tp, cp, ep or dp groups run side by side like
    that, and on shared cores a pair's collectives are not what they are with the other ranks idle."""
    _measure(rank, ranks, quick, device, emit, COLLECTIVES, None)
    if measures_pairs(ranks):
        pairs = [dist.new_group([first, first + 1]) for first in range(0, ranks, 2)]  # every rank makes each
        _measure(rank, 2, quick, device, emit, PAIR_COLLECTIVES, pairs[rank // 2])


def measures_pairs(ranks: int) -> bool:
    """Whether a profile of `ranks` ranks also times PAIR_COLLECTIVES over pairs of ranks side by side."""
    return ranks >= 4 and ranks % 2 == 0


def _measure(rank: int, ranks: int, quick: bool, device: torch.device, emit: Callable[[CollectivePoint], None],
             collectives: tuple[str, ...], group) -> None:
    for collective in collectives:
        for size in message_sizes(quick):
            call = _one_call(collective, rank, ranks, size, device, group)
            seconds = median_seconds(call, device, repeats=3 if quick else 7, min_seconds=0.01 if quick else 0.05,
                                     agree=lambda count: agree_with_rank0(count, device),
                                     before_sample=dist.barrier)
            if collective == "send_recv":
                seconds /= 2
            if rank == 0:
                emit(CollectivePoint(collective, ranks, size, seconds, size * bus_factor(collective, ranks) / seconds))
