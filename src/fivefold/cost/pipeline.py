"""Pipeline schedules: the textbook bubble of each, and the time of m micro-batches through p ranks.

Textbook bubbles (`bubble_ratio`, the planner's lower bound), as a fraction of the ideal time, for p
ranks, m micro-batches, v model chunks per rank and per-micro-batch F, B (input gradient), W (weight
gradient) of one rank:
    gpipe, 1f1b          (p - 1) / m                                  (Huang et al. 2019; Narayanan 2021)
    interleaved-1f1b     (p - 1) / (v m)                              (Narayanan et al. 2021)
    zb-h1                (p - 1) (F + B - W) / (m (F + B + W))        (Qi et al. 2024, Table 2)
    zbv                  (p - 1) max(0, F + B - 2W) / (2 m (F + B + W))  (Qi et al. 2024, ZB-V)

What the step takes (`schedule_time`) is the longest path through the action orders torch 2.13 runs
(sim/schedules.py), for identical stages with per-chunk times f, b, w. Each term below is such a path;
the simulator replays the same orders and tests/test_cost_pipeline.py checks the two agree:
    gpipe, 1f1b        (m + p - 1)(f + b + w): the first micro-batch's forward down the pipeline, m
                       micro-batches on the last rank, the last backward back up.
    interleaved-1f1b   (v m + p - 1)(f + b + w)  (torch's depth-first order, m a multiple of p).
    zb-h1              the longest of (m + p - 1)(f + b) + max(1, m - p + 1) w (the 1F1B path, W passes
                       filling all but the last rank's drain), max(p, m) f + (m + p - 1) b + m w and
                       (m + p - 1) f + max(p, m) b + m w (paths that wait on F or on B when W is long):
                       Qi et al.'s (p - 1)(F + B - W) bubble when m >= p and W <= F; with m < p there is
                       no steady state and only one W can hide.
    zbv (full V, m >= 2p - 1)
                       2 m (f + b + w) + the drain of the V's last input gradient across the ranks:
                       the longest of (p - 1) b, 2 (p - 1)(b - w), (p - 1)(2 f - b) - w, f + (p - 2) w.
    zbv (m <= p)       the first micro-batch's round trip through the whole V, 2p (f + b), then the
                       rank's remaining backward work, 2 (m - 1) b + 2 m w; or the 1F1B-like path
                       2 m (f + b + w) + (p - 1)(f + b), whichever is longer.
    zbv (p < m < 2p-1) torch builds the V for 2p - 1 micro-batches and drops the missing ones, so it is
                       partly filled: linear between the m = p and m = 2p - 1 values (within ~4% of the
                       replay over F:B:W from 1:0.7:0.3 to 1:2.5:1.5; exact at both ends).
    zbv (any m)        also one chunk's m micro-batches with every other chunk crossed once each way,
                       (2p - 1)(f + b) + m (f + b + w) + w: the path through a heavy chunk (the LM head).
Unequal ranks (`rank_path_time`): in each path the terms repeated m times are one rank's own work and
the fill and drain terms cross the other ranks (their mean chunk); the step is the longest such path over
the ranks. For 1F1B this is m max_r w_r + (sum_r w_r - max_r w_r), exact when the slowest rank is the
last. The ZBV paths that run through the V's bottom only count for rank p - 1, and a path repeating a
single chunk (the LM head's, on rank 0) is added. Interleaved and ZB-V ranks whose chunks differ (uneven
layers per stage, the embedding or LM head on one chunk) have no such closed form: the replay ran 5-20%
longer than it (ZB-V's drain with a heavier rank 0: ~4% shorter). For them the detailed estimate walks
torch's orders instead (`walk_orders`, `walked_pipeline`: the simulator's replay without collectives and
link queues, linear in the actions); the planner's quick score keeps the closed form.

Activation transfers on the critical path (`critical_hops`, in units of one hop): fill and drain cross
2 (p - 1) hops (2 (v p - 1) interleaved, 4 (p - 1) for the V). 1F1B's dependency graph has a cycle
through all p ranks whose mean per micro-batch is the ranks' mean work plus 2 (p - 1) / p hops; once
m > p the steady state runs at the slower of that and the slowest rank (for equal stages: two sends per
micro-batch, as the simulator shows), and before it every micro-batch waits on the next rank's reply
(2 hops). Blocking sends (Megatron-LM's older p2p) hold the sender: about two transfers per
micro-batch on the path (three interleaved with v = 2; four for the V, whose middle ranks send both
chunks both ways, two at p = 2).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Sequence

from fivefold.cost.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, rank_orders,
                                     stage_owners as order_owners)


def bubble_ratio(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1,
                 forward: float = 1.0, backward_input: float = 1.0, backward_weight: float = 1.0) -> float:
    """Idle time over ideal time of a homogeneous pipeline (the textbook formulas in the module docstring)."""
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


def rank_path_time(schedule: str, pp: int, virtual_stages: int, micro_batches: int,
                   own: tuple[float, float, float], others: tuple[float, float, float], bottom: bool = True) -> float:
    """The longest of the schedule's critical paths (module docstring) that repeat one rank's work: its
    per-micro-batch work (all its chunks) is `own` = (F, B, W), each chunk of the other p - 1 ranks takes
    `others` = (f, b, w). The terms a path repeats m times are the rank's own, fill and drain cross the
    others. `bottom`: the rank is the V's bottom (rank p - 1), which the short-V paths run through."""
    p, m = pp, micro_batches
    big_f, big_b, big_w = own
    f, b, w = others
    mine = m * (big_f + big_b + big_w)
    if p <= 1:
        return mine
    n = p - 1
    if schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        return mine + n * (f + b + w)
    if schedule == "zb-h1":
        return max(m * (big_f + big_b) + n * (f + b) + max(1, m - n) * big_w,
                   mine + (max(p, m) - m) * f + n * b, mine + n * f + (max(p, m) - m) * b)
    if schedule != "zbv":
        raise ValueError(schedule)
    # One of the rank's two chunks repeated m times, every other chunk crossed once each way.
    one_chunk = m * (big_f + big_b + big_w - f - b - w) + (2 * p - 1) * (f + b) + w

    def full(batches: int) -> float:  # the V filled: the last input gradient drains across the ranks
        drain = max(n * b, 2 * n * (b - w), n * (2 * f - b) - w, f + (n - 1) * w)
        return batches * (big_f + big_b + big_w) + drain

    def short(batches: int) -> float:
        if not bottom:
            return one_chunk
        # Through the V's bottom: the first micro-batch's round trip, then the rank's backward work; or
        # 1F1B-like, the rank's m micro-batches between one fill and one drain.
        return max(one_chunk, big_f + 2 * n * (f + b) + batches * (big_b + big_w),
                   batches * (big_f + big_b + big_w) + n * (f + b))

    if m >= 2 * p - 1:
        return max(full(m), one_chunk)
    if m <= p:
        return short(m)
    return max(one_chunk, short(p) + (full(2 * p - 1) - short(p)) * (m - p) / (p - 1))


def schedule_time(schedule: str, pp: int, virtual_stages: int, micro_batches: int, forward: float,
                  backward_input: float, backward_weight: float) -> float:
    """Seconds from the first forward to the last backward of identical stages whose chunks take
    (forward, backward_input, backward_weight) per micro-batch, without communication (module docstring)."""
    v = virtual_stages
    chunk = (forward, backward_input, backward_weight)
    return rank_path_time(schedule, pp, v, micro_batches, (v * forward, v * backward_input, v * backward_weight),
                          chunk)


def critical_hops(schedule: str, pp: int, virtual_stages: int, micro_batches: int,
                  async_p2p: bool) -> tuple[float, float, int]:
    """Activation (or gradient) transfers on the critical path of one step (module docstring):
    (hops paid once, hops of the steady-state cycle per micro-batch, micro-batches that cycle)."""
    p, v, m = pp, virtual_stages, micro_batches
    if p <= 1:
        return 0.0, 0.0, 0
    if not async_p2p:
        if schedule == "interleaved-1f1b":
            return (v + 1) * m + 2 * p - 3, 0.0, 0
        if schedule == "zbv":  # a middle rank sends both chunks both ways; the V's ends hand over locally
            return (4 if p > 2 else 2) * m + 2, 0.0, 0
        return 2 * (m + p - 2), 0.0, 0
    if schedule == "1f1b":  # before the steady state every micro-batch waits on the next rank's reply
        return 2 * (p - 1) + 2 * max(0, min(m, p) - 2), 2 * (p - 1) / p, max(0, m - p)
    if schedule == "interleaved-1f1b":
        return 2 * (v * p - 1), 0.0, 0
    if schedule == "zb-h1":  # the deferred W passes absorb the steady-state round trips after p of them
        return 2 * (p - 1) + 2 * min(max(0, m - 2), p - 1), 0.0, 0
    if schedule == "zbv":
        return 4 * (p - 1), 0.0, 0
    return 2 * (p - 1), 0.0, 0


@dataclass(frozen=True)
class PipelineTime:
    total: float  # seconds from the first forward to the last backward of the step
    busy: float  # m x the slowest rank's per-micro-batch work
    bubble: float  # idle time of the slowest rank (fill and drain)
    p2p: float  # point-to-point transfers on the critical path


def pipeline_time(schedule: str, pp: int, virtual_stages: int, micro_batches: int,
                  rank_work: list[tuple[float, float, float]], hop: float, async_p2p: bool,
                  ranks: list[list[int]] | None = None) -> PipelineTime:
    """Step time of the pipeline from each rank's (F, B, W) for one micro-batch (all its chunks summed).

    The longest critical path over the ranks (rank_path_time with that rank's work repeated and the
    others' mean chunk crossed); busy = m * max_r (F_r + B_r + W_r), the bubble the rest; p2p =
    critical_hops * hop, the slowest hop. `ranks[i]` lists the pp ranks that share rank_work[i]
    (default: entry i is rank i).
    """
    m, p, v = micro_batches, pp, virtual_stages
    ranks = ranks or [[i] for i in range(len(rank_work))]
    counts = [len(r) for r in ranks]
    slowest = max(f + b + w for f, b, w in rank_work)
    busy = m * slowest
    if p <= 1:
        return PipelineTime(busy, busy, 0.0, 0.0)
    sums = [sum(n * x[i] for n, x in zip(counts, rank_work)) for i in range(3)]
    chunks = (p - 1) * v
    longest = max(rank_path_time(schedule, p, v, m, work, ((sums[0] - work[0]) / chunks, (sums[1] - work[1]) / chunks,
                                                          (sums[2] - work[2]) / chunks), p - 1 in members)
                  for work, members in zip(rank_work, ranks))
    once, cycle, cycles = critical_hops(schedule, p, v, m, async_p2p)
    # The steady state runs at the slower of the slowest rank and the cycle through all ranks, whose
    # mean work per micro-batch is the ranks' mean plus its share of the round trip.
    mean = sum(sums) / p
    p2p = once * hop + cycles * max(0.0, mean + cycle * hop - slowest)
    return PipelineTime(longest + p2p, busy, longest - busy, p2p)


def walk_orders(schedule: str, pp: int, virtual_stages: int, micro_batches: int,
                stages: list[tuple[float, float, float, float]], async_p2p: bool = True) -> float:
    """Seconds from the first forward to the last backward when each rank runs torch's action order
    (cost/schedules.py) and each action waits for its input: the simulator's replay without its
    collectives and link queues. `stages[i]` = (F, B, W, send) of virtual stage i for one micro-batch; an
    activation (gradient) crossing to another rank arrives `send` after it is produced, and holds the sender
    that long when sends block. A rank runs until its next input is missing and is woken when it arrives,
    so each action is looked at a constant number of times; the orders come pre-compiled to flat integer
    programs (_walk_program), so the loop only adds times."""
    program, keys = _walk_program(schedule, pp, virtual_stages, micro_batches)
    durations = [x for forward, backward, weight, _ in stages for x in (forward, backward, backward + weight, weight)]
    sends = [stage[3] for stage in stages]
    ready: list[float] = [-1.0] * keys  # -1: not produced yet (every real time is >= 0)
    parked = [-1] * keys
    free, cursor, todo = [0.0] * pp, [0] * pp, list(range(pp))
    while todo:
        rank = todo.pop()
        code, index, t = program[rank], cursor[rank], free[rank]
        end = len(code)
        while index < end:
            needs = code[index]
            if needs >= 0:
                arrived = ready[needs]
                if arrived < 0.0:
                    parked[needs] = rank
                    break
                if arrived > t:
                    t = arrived
            t += durations[code[index + 1]]
            done = code[index + 4]  # a local input the action makes (last forward done, I done)
            if done >= 0:
                ready[done] = t
                if parked[done] >= 0:
                    todo.append(parked[done])
                    parked[done] = -1
            out = code[index + 2]
            if out >= 0:
                sent = code[index + 3]
                arrives = t
                if sent >= 0:
                    arrives = t + sends[sent]
                    if not async_p2p:
                        t = arrives
                ready[out] = arrives
                if parked[out] >= 0:
                    todo.append(parked[out])
                    parked[out] = -1
            index += 5
        cursor[rank], free[rank] = index, t
    if any(cursor[r] < len(program[r]) for r in range(pp)):
        raise RuntimeError(f"schedule {schedule} deadlocks")
    return max(free)


@lru_cache(maxsize=32)
def _walk_program(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> tuple[list[list[int]], int]:
    """Each rank's order as groups of 5 ints: (input key or -1, index into the (F, B, B+W, W) durations,
    output key or -1, stage whose send time the output pays or -1 when it stays on the rank, local key the
    action completes or -1); and the number of keys. Keys: activation inputs [0, size), gradient inputs
    [size, 2 size), the last stage's forward done [2 size, 3 size), input gradient done [3 size, 4 size)."""
    orders = rank_orders(schedule, pp, virtual_stages, micro_batches)
    owner = order_owners(orders)
    m = micro_batches
    last = max(owner)
    size = (last + 1) * m
    programs = []
    for rank, actions in enumerate(orders):
        code: list[int] = []
        for kind, stage, micro_batch in actions:
            at = stage * m + micro_batch
            if kind == FORWARD:
                needs = -1 if stage == 0 else at
                if stage == last:
                    code += (needs, 4 * stage, -1, -1, 2 * size + at)
                else:
                    code += (needs, 4 * stage, at + m, -1 if owner[stage + 1] == rank else stage, -1)
            elif kind == BACKWARD_WEIGHT:
                code += (3 * size + at, 4 * stage + 3, -1, -1, -1)
            else:
                needs = 2 * size + at if stage == last else size + at
                slot = 4 * stage + (2 if kind == BACKWARD else 1)
                done = 3 * size + at if kind == BACKWARD_INPUT else -1
                out, sent = (-1, -1) if stage == 0 else \
                    (size + at - m, -1 if owner[stage - 1] == rank else stage - 1)
                code += (needs, slot, out, sent, done)
        programs.append(code)
    return programs, 4 * size


WALK_SCHEDULES = ("interleaved-1f1b", "zbv")  # several chunks per rank: equal chunks is what the closed form assumes


def walked_pipeline(pipe: PipelineTime, schedule: str, pp: int, virtual_stages: int, micro_batches: int,
                    stages: list[tuple[float, float, float, float]], owners: Sequence[int],
                    async_p2p: bool = True) -> PipelineTime:
    """`pipe` (the closed form) with its total taken from walk_orders where the closed form does not hold:
    interleaved or ZB-V ranks whose chunks differ (uneven layers per stage, the embedding or LM head on
    one chunk). Once the pipeline is full the walk grows by the same time per round of p micro-batches (ZB-V
    settles after ~5 rounds at p = 4), so past 16 rounds 8 and 16 rounds are walked and the rest
    extrapolated (tests/test_cost_pipeline.py checks it against the whole walk); the walk of the 1T GPT
    on 64 ranks (512 micro-batches) takes ~0.05 s. `stages[i]` = (F, B, W, send) of virtual stage i,
    `owners[i]` its pp rank."""
    if schedule not in WALK_SCHEDULES or pp <= 1:
        return pipe
    chunks: dict[int, list[tuple[float, float, float]]] = {}
    for (forward, backward, weight, _), owner in zip(stages, owners):
        chunks.setdefault(owner, []).append((forward, backward, weight))
    if all(max(abs(a - b) for a, b in zip(work, mine[0])) <= 1e-9 * max(sum(mine[0]), 1e-30)
           for mine in chunks.values() for work in mine):
        return pipe
    unit, m = pp, micro_batches  # micro-batches per round
    if m > 16 * unit and (schedule == "zbv" or m % unit == 0):
        near, far = (walk_orders(schedule, pp, virtual_stages, k * unit, stages, async_p2p) for k in (8, 16))
        total = far + (m - 16 * unit) * (far - near) / (8 * unit)
    else:
        total = walk_orders(schedule, pp, virtual_stages, m, stages, async_p2p)
    p2p = max(0.0, min(pipe.p2p, total - pipe.busy))
    return replace(pipe, total=total, bubble=max(0.0, total - pipe.busy - p2p), p2p=p2p)


def walked_pipelines(pipe: PipelineTime, held: float, schedule: str, pp: int, virtual_stages: int,
                     micro_batches: int, stages: list[tuple[float, float, float, float]], owners: Sequence[int],
                     held_by: list[list[float]], async_p2p: bool = True) -> tuple[PipelineTime, float]:
    """walked_pipeline of `pipe`, and of the pipeline whose passes data-parallel collectives hold up (`held`
    in closed form; `held_by[i]` = how much longer stage i's F, B and W take, as its rank's): both unchanged
    unless a rank's chunks differ, the held-up one then walked with each stage stretched in that proportion."""
    args = (schedule, pp, virtual_stages, micro_batches)
    walked = walked_pipeline(pipe, *args, stages, owners, async_p2p)
    if walked is pipe or held == pipe.total:
        return walked, walked.total + held - pipe.total
    held_stages = [(f * x[0], b * x[1], w * x[2], send) for (f, b, w, send), x in zip(stages, held_by)]
    return walked, walked_pipeline(pipe, *args, held_stages, owners, async_p2p).total
