"""The exact action order of every pipeline schedule, per pp rank. The one place orders are generated.

Each rank runs its list top to bottom; an action waits for its inputs (the simulator's job), never
reorders. The orders are those that torch.distributed.pipelining (torch 2.13) executes for the same
number of ranks, stages and micro-batches; tests/test_sim_schedules.py checks that action for action:

| fivefold         | torch class                                   | stages per rank              |
|------------------|-----------------------------------------------|------------------------------|
| gpipe            | ScheduleGPipe                                 | 1                            |
| 1f1b             | Schedule1F1B                                  | 1                            |
| interleaved-1f1b | ScheduleInterleaved1F1B                       | v, looped (rank r: r, r+p..) |
| zb-h1            | ScheduleInterleavedZeroBubble with 1 stage    | 1                            |
| zbv              | ScheduleZBVZeroBubble                         | 2, V-shaped (r and 2p-1-r)   |

zb-h1: torch has no class of that name. Its ScheduleInterleavedZeroBubble ("ZB1P") with one stage per
rank is the ZB-H1 schedule of Qi et al. 2024, section 2.1: 1F1B with the backward split into B
(input gradient, here "I") and W (weight gradient), and rank r holding back its W passes until r
steady-state B passes have run, so that B reaches the earlier ranks sooner while no rank keeps more
micro-batches alive than under 1F1B.

For gpipe and 1f1b torch runs a hand-written loop (`_step_microbatches`); its `pipeline_order`
attribute is only a drawing aid and, for 1F1B in torch 2.13, misnumbers the last rank's forwards.
The orders here follow the loop that actually runs.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Sequence

from fivefold.errors import SpecError
from fivefold.spec.plan import SPLIT_BACKWARD  # noqa: F401 - re-exported for the simulator

FORWARD = "F"  # forward of one stage for one micro-batch
BACKWARD = "B"  # full backward (input and weight gradients together)
BACKWARD_INPUT = "I"  # zero-bubble schedules: input-gradient half of the backward
BACKWARD_WEIGHT = "W"  # zero-bubble schedules: weight-gradient half, free to run later

TORCH_SCHEDULE_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                        "interleaved-1f1b": "ScheduleInterleaved1F1B",
                        "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


class Action(NamedTuple):
    """One compute action on a rank: `kind` of virtual stage `stage` on micro-batch `micro_batch` (a tuple:
    the engine unpacks hundreds of thousands)."""

    kind: str  # F, B, I or W
    stage: int  # virtual stage index in model order
    micro_batch: int  # micro-batch index within the step

    def __str__(self) -> str:  # the same spelling as torch's _Action, e.g. "3F0"
        return f"{self.stage}{self.kind}{self.micro_batch}"


def rank_orders(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> tuple[tuple[Action, ...], ...]:
    """The ordered actions of each pp rank for one step: result[rank] = (Action, ...). Cached and immutable:
    the estimate's walk and the simulator ask for the same orders (the 1T plan's take ~0.1 s to build)."""
    return _rank_orders(schedule, pp, virtual_stages, micro_batches)


@lru_cache(maxsize=16)
def _rank_orders(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(actions) for actions in _build_orders(schedule, pp, virtual_stages, micro_batches))


def _build_orders(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> list[list[Action]]:
    if schedule not in TORCH_SCHEDULE_CLASS:
        raise SpecError("schedule", schedule, f"use one of {', '.join(TORCH_SCHEDULE_CLASS)}")
    if pp < 1 or micro_batches < 1:
        raise SpecError("pp, micro_batches", (pp, micro_batches), "both must be >= 1")
    expected_virtual = {"interleaved-1f1b": None, "zbv": 2}.get(schedule, 1)
    if expected_virtual is None and virtual_stages < 2:
        raise SpecError("virtual_stages", virtual_stages, "interleaved-1f1b needs 2 or more")
    if expected_virtual is not None and virtual_stages != expected_virtual:
        raise SpecError("virtual_stages", virtual_stages, f"{schedule} uses {expected_virtual}")
    if schedule == "gpipe":
        return [_gpipe(rank, micro_batches) for rank in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(rank, pp, micro_batches) for rank in range(pp)]
    if schedule == "interleaved-1f1b":
        return [_looped(rank, pp, virtual_stages, micro_batches, zero_bubble=False) for rank in range(pp)]
    if schedule == "zb-h1":
        return [_looped(rank, pp, 1, micro_batches, zero_bubble=True) for rank in range(pp)]
    return [_zbv(rank, pp, micro_batches) for rank in range(pp)]


def stage_owners(orders: Sequence[Sequence[Action]]) -> dict[int, int]:
    """stage -> the rank whose order runs it (looped for interleaved, V-shaped for zbv)."""
    return {action.stage: rank for rank, actions in enumerate(orders) for action in actions}


# --- single-stage schedules: the loops of ScheduleGPipe / Schedule1F1B._step_microbatches --------

def _gpipe(rank: int, micro_batches: int) -> list[Action]:
    forwards = [Action(FORWARD, rank, i) for i in range(micro_batches)]
    return forwards + [Action(BACKWARD, rank, i) for i in range(micro_batches)]  # backward in forward order


def _one_f_one_b(rank: int, pp: int, micro_batches: int) -> list[Action]:
    # Rank r runs pp - r forwards before its first backward, then alternates backward and forward.
    warmup = min(micro_batches, pp - rank)
    actions = [Action(FORWARD, rank, i) for i in range(warmup)]
    next_forward = warmup
    for backward in range(micro_batches):
        actions.append(Action(BACKWARD, rank, backward))
        if next_forward < micro_batches:
            actions.append(Action(FORWARD, rank, next_forward))
            next_forward += 1
    return actions


# --- looped schedules: ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble -----------------

def _looped(rank: int, pp: int, local_stages: int, micro_batches: int, zero_bubble: bool) -> list[Action]:
    """Depth-first interleaved 1F1B (Narayanan et al. 2021) as torch builds it: micro-batches go through
    the local stages in rounds of `per_round`; with `zero_bubble` the backward is split into I and W and
    rank r delays its W passes by r steps (ZB-1P; with one local stage, ZB-H1)."""
    rounds = max(1, micro_batches // pp)
    if micro_batches % rounds:
        raise SpecError("micro_batches", micro_batches, f"must be a multiple of {rounds} rounds for pp={pp}")
    per_round = micro_batches // rounds
    total = local_stages * micro_batches  # forward (and backward) actions on this rank
    # The last rank warms up one round per extra local stage; each hop away adds 2 (1 with zero bubble).
    hop_factor = 1 if zero_bubble else 2
    warmup = min((local_stages - 1) * per_round + hop_factor * (pp - 1 - rank), total)

    def backward_chunk(step: int) -> int:
        return local_stages - 1 - ((step - warmup) // per_round) % local_stages

    # The next micro-batch of each local stage per kind of action; chunk c is stage c * pp + rank. (The
    # 1T plan's walk builds ~400k actions, so the loop stays flat.)
    forwards, backwards, weights = [0] * local_stages, [0] * local_stages, [0] * local_stages
    backward_kind = BACKWARD_INPUT if zero_bubble else BACKWARD
    actions: list[Action] = []
    backward_steps: list[int] = []  # the op index of each backward so far, in order: W follows it
    weights_done = 0

    def take_weight(chunk: int) -> Action:
        weights[chunk] += 1
        return Action(BACKWARD_WEIGHT, chunk * pp + rank, weights[chunk] - 1)

    for step in range(total + warmup):  # warmup forwards, steady F+B pairs, cooldown backwards
        if step < total:
            chunk = (step // per_round) % local_stages
            actions.append(Action(FORWARD, chunk * pp + rank, forwards[chunk]))
            forwards[chunk] += 1
            if step < warmup:
                continue
        chunk = backward_chunk(step)
        actions.append(Action(backward_kind, chunk * pp + rank, backwards[chunk]))
        backwards[chunk] += 1
        backward_steps.append(step)
        if zero_bubble and step - warmup >= rank:
            actions.append(take_weight(backward_chunk(backward_steps[weights_done])))
            weights_done += 1
    if zero_bubble:
        for step in backward_steps[weights_done:]:
            actions.append(take_weight(backward_chunk(step)))
    return actions


# --- ScheduleZBVZeroBubble (Qi et al. 2024, section 6) ---------------------------------------------

def _zbv(rank: int, pp: int, micro_batches: int) -> list[Action]:
    """Two stages per rank in a V: rank r holds stage r (chunk 0) and stage 2pp-1-r (chunk 1)."""
    chunk0, chunk1 = rank, 2 * pp - 1 - rank
    # The schedule is built for at least 2pp-1 micro-batches; extra ones are dropped afterwards.
    padded = max(2 * pp - 1, micro_batches)
    stage_of = (chunk0, chunk1)
    # micro-batches emitted so far per kind and chunk (the planner walks ~10^5 actions: no dict or string per emit)
    f, b, w = [0, 0], [0, 0], [0, 0]
    tally = {FORWARD: f, BACKWARD_INPUT: b, BACKWARD_WEIGHT: w}
    actions: list[Action] = []
    append = actions.append

    def emit(kind: str, chunk: int) -> None:
        done = tally[kind]
        append(Action(kind, stage_of[chunk], done[chunk]))
        done[chunk] += 1

    for _ in range(2 * (pp - rank) - 1):  # warmup 1: forwards of chunk 0
        emit(FORWARD, 0)
    for _ in range(rank):  # warmup 2: alternate chunk 1 and chunk 0 forwards
        emit(FORWARD, 1)
        emit(FORWARD, 0)
    for _ in range(pp - rank):  # warmup 3: chunk 1 forward, then its full backward
        emit(FORWARD, 1)
        emit(BACKWARD_INPUT, 1)
        emit(BACKWARD_WEIGHT, 1)
    while f[1] < f[0] or f[0] < padded:  # steady state
        if f[0] < padded:
            emit(FORWARD, 0)
        emit(BACKWARD_INPUT, 0)
        emit(BACKWARD_WEIGHT, 0)
        emit(FORWARD, 1)
        emit(BACKWARD_INPUT, 1)
        emit(BACKWARD_WEIGHT, 1)
    for _ in range(rank):  # cooldown: input gradients first, weights fill the tail
        emit(BACKWARD_INPUT, 0)
        emit(BACKWARD_INPUT, 1)
    for _ in range(pp - rank):
        emit(BACKWARD_INPUT, 0)
        emit(BACKWARD_WEIGHT, 0)
    while w[1] < b[1]:
        emit(BACKWARD_WEIGHT, 1)
    while w[0] < b[0]:
        emit(BACKWARD_WEIGHT, 0)
    return [a for a in actions if a.micro_batch < micro_batches]
