"""Where the vocabulary passes of --vocab-parallel go in torch.distributed.pipelining's action lists
(runtime/vocab_parallel.py computes them).

Collectives over the pp group must come in the same order on every rank, so the pass of micro-batch i goes into
every rank's list where a dependency-driven walk of the compute-only schedule stands when the last stage has
finished its forward of i (insert_vocab_passes). The walk is a valid execution of the lists with each pass as a
barrier, so the lists cannot deadlock. Every schedule runs as torch's action-list runtime
(_PipelineScheduleRuntime), whose lowering adds the sends, receives, FSDP and gradient-reduction actions; the
passes are spliced in before the compute action that follows them.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD,
                                                    RECV_B, REDUCE_GRAD, SEND_B, _Action, _PipelineScheduleRuntime)

if TYPE_CHECKING:
    from fivefold.runtime.vocab_parallel import VocabParallel

BACKWARD_ACTIONS = (FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, SEND_B, RECV_B, REDUCE_GRAD)


class VocabPass(str, Enum):
    """The action type of a vocabulary pass in torch's action lists (`.value` is what its repr prints)."""

    VOCAB = "VOCAB"


def vocab_schedule(schedule_class: type, stages: list, micro_batches: int, vocab: "VocabParallel"
                   ) -> _PipelineScheduleRuntime:
    """The plan's schedule as torch's action-list runtime, with a vocabulary pass per micro-batch (torch 2.13:
    Schedule1F1B runs its own loop, so its action lists run under _PipelineScheduleRuntime instead)."""
    if issubclass(schedule_class, _PipelineScheduleRuntime):
        schedule = schedule_class(stages, n_microbatches=micro_batches, loss_fn=vocab.loss_fn, scale_grads=False)
        order = schedule.pipeline_order
    else:  # GPipe and 1F1B run their own loops; torch 2.13's Schedule1F1B._get_pipeline_order starts the last
        # stage at micro-batch 1, so their lists are written here
        order = (one_f_one_b_order if schedule_class.__name__ == "Schedule1F1B" else gpipe_order)(
            stages[0].num_stages, micro_batches)
        schedule = _PipelineScheduleRuntime(stages, n_microbatches=micro_batches, loss_fn=vocab.loss_fn,
                                            scale_grads=False)
    schedule._prepare_schedule_with_comms(order)  # torch's own lowering: sends, receives, FSDP, grad reduction
    last_stage = stages[0].num_stages - 1
    lists = {}
    for training in (True, False):  # the step, and the forward-only pass of validation (no backward actions)
        compute = {rank: [a for a in actions if a is not None and (training or a.computation_type == FORWARD)]
                   for rank, actions in order.items()}
        with_passes = insert_vocab_passes(compute, last_stage, micro_batches)
        lists[training] = {rank: splice_vocab_passes([a for a in actions if training or a.computation_type
                                                      not in BACKWARD_ACTIONS], with_passes[rank])
                           for rank, actions in schedule.pipeline_order_with_comms.items()}
    schedule.pipeline_order_with_comms = lists[True]
    vocab.attach({stage.stage_index: stage.submod for stage in stages}, schedule, lists)
    return schedule


def one_f_one_b_order(stages: int, micro_batches: int) -> dict[int, list[_Action | None]]:
    """1F1B (Narayanan et al. 2021, PipeDream-Flush) as action lists: stage r runs stages-1-r forwards, then one
    forward and one backward at a time, then the remaining backwards (Schedule1F1B._step_microbatches' order)."""
    order: dict[int, list[_Action | None]] = {}
    for rank in range(stages):
        warmup = min(stages - 1 - rank, micro_batches)
        actions: list[_Action | None] = [_Action(rank, FORWARD, i) for i in range(warmup)]
        for i in range(micro_batches - warmup):
            actions += [_Action(rank, FORWARD, warmup + i), _Action(rank, FULL_BACKWARD, i)]
        actions += [_Action(rank, FULL_BACKWARD, i) for i in range(micro_batches - warmup, micro_batches)]
        order[rank] = actions
    return order


def gpipe_order(stages: int, micro_batches: int) -> dict[int, list[_Action | None]]:
    """GPipe (Huang et al. 2019) as action lists: every forward, then every backward, on each stage."""
    return {rank: [*(_Action(rank, FORWARD, i) for i in range(micro_batches)),
                   *(_Action(rank, FULL_BACKWARD, i) for i in range(micro_batches))] for rank in range(stages)}


def splice_vocab_passes(lowered: list[_Action], compute_with_passes: list[_Action]) -> list[_Action]:
    """torch's lowered list of one rank (compute and communication) with each vocabulary pass placed before the
    compute action that follows it in `compute_with_passes` (the send/receive posts are non-blocking)."""
    passes_before: list[list[_Action]] = [[]]
    for action in compute_with_passes:
        if action.computation_type == VocabPass.VOCAB:
            passes_before[-1].append(action)
        else:
            passes_before.append([])
    result: list[_Action] = []
    compute_seen = 0
    for action in lowered:
        if action.is_compute_op:
            result.extend(passes_before[compute_seen])
            compute_seen += 1
        result.append(action)
    assert compute_seen == len(passes_before) - 1, "the lowered list lost compute actions"
    return result + passes_before[compute_seen]


def insert_vocab_passes(order: dict[int, list[_Action]], last_stage: int, micro_batches: int
                        ) -> dict[int, list[_Action]]:
    """Each rank's compute actions with a VocabPass action per micro-batch, at the point where a dependency-
    driven walk of all ranks stands when the last stage's forward of that micro-batch is done. Dependencies:
    F(s, i) after F(s-1, i); B or I (s, i) after F(s, i) and B/I(s+1, i), the last stage's after V(i);
    W(s, i) after I(s, i); V(i) after F(last, i), on every rank at once."""
    done: set[tuple[str, int, int]] = set()
    position = {rank: 0 for rank in order}
    result: dict[int, list[_Action]] = {rank: [] for rank in order}
    next_pass = 0

    def ready(action: _Action) -> bool:
        stage, kind, mb = action.stage_index, action.computation_type, action.microbatch_index
        if kind == FORWARD:
            return stage == 0 or ("F", stage - 1, mb) in done
        if kind in (FULL_BACKWARD, BACKWARD_INPUT):
            after = ("V", last_stage, mb) if stage == last_stage else None
            later = stage == last_stage or ("B", stage + 1, mb) in done
            return ("F", stage, mb) in done and later and (after is None or after in done)
        if kind == BACKWARD_WEIGHT:
            return ("B", stage, mb) in done
        raise AssertionError(f"unexpected action {action} in a compute-only schedule")

    while any(position[rank] < len(order[rank]) for rank in order):
        progressed = False
        for rank in sorted(order):
            if position[rank] >= len(order[rank]):
                continue
            action = order[rank][position[rank]]
            if not ready(action):
                continue
            kind = action.computation_type
            done.add(("F" if kind == FORWARD else "W" if kind == BACKWARD_WEIGHT else "B",
                      action.stage_index, action.microbatch_index))
            result[rank].append(action)
            position[rank] += 1
            progressed = True
            while next_pass < micro_batches and ("F", last_stage, next_pass) in done:
                for other in result:
                    result[other].append(_Action(last_stage, VocabPass.VOCAB, next_pass))  # type: ignore[arg-type]
                done.add(("V", last_stage, next_pass))
                next_pass += 1
        assert progressed, "the compute-only schedule cannot be walked"
    assert next_pass == micro_batches
    return result
