"""Pipeline schedules: the textbook bubble of each, and the time of m micro-batches through p ranks.

Bubble as a fraction of the ideal (bubble-free) time, for p ranks, m micro-batches per step, v model
chunks per rank, and per-micro-batch forward F, input-backward B and weight-backward W of one rank:
    gpipe, 1f1b          (p - 1) / m                                  (Huang et al. 2019; Narayanan 2021)
    interleaved-1f1b     (p - 1) / (v m)                              (Narayanan et al. 2021)
    zb-h1                (p - 1) (F + B - W) / (m (F + B + W))        (Qi et al. 2024, Table 2)
    zbv                  (p - 1) max(0, F + B - 2W) / (2 m (F + B + W))  (Qi et al. 2024, ZB-V: the
                         ZB-H2 bubble of half-size chunks, at 1F1B's memory)
"""

from __future__ import annotations

from dataclasses import dataclass


def bubble_ratio(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1,
                 forward: float = 1.0, backward_input: float = 1.0, backward_weight: float = 1.0) -> float:
    """Idle time over ideal time of a homogeneous pipeline (the formulas in the module docstring)."""
    p, m, v = pp, micro_batches, virtual_stages
    if p <= 1:
        return 0.0
    f, b, w = forward, backward_input, backward_weight
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m)
    if schedule == "zb-h1":
        return (p - 1) * (f + b - w) / (m * (f + b + w))
    if schedule == "zbv":
        return (p - 1) * max(0.0, f + b - 2 * w) / (2 * m * (f + b + w))
    raise ValueError(schedule)


@dataclass(frozen=True)
class PipelineTime:
    total: float  # seconds from the first forward to the last backward of the step
    busy: float  # m x the slowest rank's per-micro-batch work
    bubble: float  # idle time of the slowest rank (fill and drain)
    p2p: float  # point-to-point transfers on the critical path


def pipeline_time(schedule: str, pp: int, virtual_stages: int, micro_batches: int,
                  rank_work: list[tuple[float, float, float]], hop: float, async_p2p: bool,
                  counts: list[int] | None = None) -> PipelineTime:
    """Step time of the pipeline from each rank's (F, B, W) for one micro-batch (all its chunks summed).

    The slowest rank sets the steady-state pace: busy = m * max_r (F_r + B_r + W_r). Fill and drain add
    (sum_r w_r - max_r w_r) for 1F1B/GPipe (the heterogeneous form of (p-1) w; PipeDream-style analysis),
    divided by v for interleaved; zero-bubble schedules scale it by their bubble over 1F1B's bubble,
    evaluated with the pipeline-wide F, B, W. Each of the 2 (p-1) hops of fill and drain costs one
    activation transfer; without async p2p (Megatron's blocking send/recv) the steady state pays two per
    micro-batch as well. `counts` (default all 1) says how many ranks share each rank_work entry.
    """
    m, p, v = micro_batches, pp, virtual_stages
    counts = counts or [1] * len(rank_work)
    slowest = max(f + b + w for f, b, w in rank_work)
    busy = m * slowest
    if p <= 1:
        return PipelineTime(busy, busy, 0.0, 0.0)
    f = sum(n * x[0] for n, x in zip(counts, rank_work))
    b = sum(n * x[1] for n, x in zip(counts, rank_work))
    w = sum(n * x[2] for n, x in zip(counts, rank_work))
    fill_drain = f + b + w - slowest
    if schedule == "interleaved-1f1b":
        bubble = fill_drain / v
    elif schedule in ("zb-h1", "zbv"):
        bubble = fill_drain * bubble_ratio(schedule, p, 1, v, f, b, w) / bubble_ratio("1f1b", p, 1)
    else:
        bubble = fill_drain
    p2p = 2 * (p - 1) * hop
    if not async_p2p:
        p2p += 2 * (m - 1) * hop
    return PipelineTime(busy + bubble + p2p, busy, bubble, p2p)
