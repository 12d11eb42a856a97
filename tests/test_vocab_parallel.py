"""--vocab-parallel without processes: where the vocabulary passes go in each rank's action list (1F1B and GPipe as
fivefold writes them; interleaved-1f1b, zbv and zb-h1 as torch 2.13 builds them), the rows each pp rank holds, and
the one-line refusals. The parity runs (losses and grad norms against one process under 1f1b,
interleaved-1f1b and zbv with dp, tp and cp) are in test_parity_plans.py, the resume across plans in
test_resume_plans.py."""

from __future__ import annotations

import pytest
import torch
from types import SimpleNamespace

from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, RECV_B,
                                                    SEND_F, _Action)

from fivefold.cli import main
from fivefold.errors import SpecError
from fivefold.runtime.vocab_parallel import check_vocab_parallel_runnable, vocab_range
from fivefold.runtime.vocab_schedule import (VocabPass, gpipe_order, insert_vocab_passes, one_f_one_b_order,
                                             splice_vocab_passes)
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster


def _kind(action: _Action) -> str:
    return {FORWARD: "F", FULL_BACKWARD: "B", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W"}.get(action.computation_type,
                                                                                              "V")


def walk_with_barriers(lists: dict[int, list[_Action]], last_stage: int) -> list[tuple[int, _Action]]:
    """Run the lists as the runtime would: an action waits for what it needs, a vocabulary pass for every rank to
    reach it (a collective). Returns the execution order; fails if the lists deadlock."""
    done: set[tuple[str, int, int]] = set()
    at = {rank: 0 for rank in lists}
    executed = []
    while any(at[r] < len(lists[r]) for r in lists):
        moved = False
        for rank in lists:
            if at[rank] >= len(lists[rank]):
                continue
            action = lists[rank][at[rank]]
            kind, stage, mb = _kind(action), action.stage_index, action.microbatch_index
            if kind == "V":  # needs the last stage's hidden states, and every rank at the same pass
                if ("F", last_stage, mb) in done and all(at[r] < len(lists[r]) and lists[r][at[r]] == action
                                                         for r in lists):
                    for r in lists:
                        at[r] += 1
                    done.add(("V", stage, mb))
                    executed.append((-1, action))
                    moved = True
                continue
            needs = []
            if kind == "F" and stage > 0:
                needs.append(("F", stage - 1, mb))
            if kind == "B":
                needs.append(("F", stage, mb))
                needs.append(("V", stage, mb) if stage == last_stage else ("B", stage + 1, mb))
            if kind == "W":
                needs.append(("B", stage, mb))
            if all(n in done for n in needs):
                done.add((kind, stage, mb))
                executed.append((rank, action))
                at[rank] += 1
                moved = True
        assert moved, f"deadlock at {at}"
    return executed


def torch_order(schedule_class: type, pp: int, micro_batches: int) -> dict[int, list[_Action]]:
    """The compute-only action lists torch 2.13 builds for `schedule_class` (stages stubbed: no process group)."""
    per_rank = 1 if schedule_class is ScheduleInterleavedZeroBubble else 2
    stages = pp * per_rank

    def owned(rank: int) -> list[int]:
        if schedule_class is ScheduleZBVZeroBubble:
            return [rank, stages - 1 - rank]
        return [rank + k * pp for k in range(per_rank)]

    orders = {}
    for rank in range(pp):
        stubs = [SimpleNamespace(stage_index=i, num_stages=stages, group_size=pp, group_rank=rank, submod=None)
                 for i in owned(rank)]
        schedule = schedule_class(stubs, n_microbatches=micro_batches, loss_fn=lambda out, target: out)
        orders[rank] = [a for a in schedule.pipeline_order[rank] if a is not None]
    return orders


ORDERS = {
    **{f"1f1b pp{p} m{m}": (p, m, one_f_one_b_order(p, m)) for p, m in ((2, 4), (4, 8), (4, 4))},
    **{f"gpipe pp{p} m{m}": (p, m, gpipe_order(p, m)) for p, m in ((2, 4), (4, 8))},
    **{f"{cls.__name__} pp{p} m{m}": (p * (1 if cls is ScheduleInterleavedZeroBubble else 2), m, torch_order(cls, p, m))
       for cls in (ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble)
       for p, m in ((2, 4), (4, 8))},
}


@pytest.mark.parametrize("name", list(ORDERS))
def test_every_rank_runs_each_vocabulary_pass_in_order_and_the_lists_cannot_deadlock(name):
    stages, micro_batches, order = ORDERS[name]
    with_passes = insert_vocab_passes(order, stages - 1, micro_batches)
    last = stages - 1
    last_rank = next(rank for rank, actions in order.items() if any(a.stage_index == last for a in actions))
    for rank, actions in with_passes.items():
        passes = [a.microbatch_index for a in actions if a.computation_type == VocabPass.VOCAB]
        assert passes == list(range(micro_batches)), rank
        assert [a for a in actions if a.computation_type != VocabPass.VOCAB] == order[rank]  # nothing else moved
    actions = with_passes[last_rank]
    for mb in range(micro_batches):  # the last stage: forward, then the pass, then its backward
        forward = actions.index(_Action(last, FORWARD, mb))
        vocab = actions.index(_Action(last, VocabPass.VOCAB, mb))  # type: ignore[arg-type]
        backward = next(i for i, a in enumerate(actions) if a.stage_index == last and a.microbatch_index == mb
                        and a.computation_type in (FULL_BACKWARD, BACKWARD_INPUT))
        assert forward < vocab < backward
    executed = walk_with_barriers(with_passes, last)
    assert len(executed) == sum(len(order[r]) for r in order) + micro_batches


def test_the_walk_catches_a_pass_placed_too_early():
    order = one_f_one_b_order(2, 2)
    early = {rank: [_Action(1, VocabPass.VOCAB, 0), *actions] for rank, actions in order.items()}  # type: ignore
    with pytest.raises(AssertionError, match="deadlock"):
        walk_with_barriers(early, 1)


def test_one_f_one_b_order_is_pipedream_flush():
    order = one_f_one_b_order(4, 6)
    assert [str(a) for a in order[3]] == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3F4", "3B4",
                                          "3F5", "3B5"]
    assert [str(a) for a in order[0][:5]] == ["0F0", "0F1", "0F2", "0F3", "0B0"]  # 3 warm-up forwards
    assert [str(a) for a in order[0][-3:]] == ["0B3", "0B4", "0B5"]


def test_splice_puts_each_pass_before_the_next_compute_action():
    lowered = [_Action(1, FORWARD, 0), _Action(1, SEND_F, 0), _Action(1, RECV_B, 0), _Action(1, FULL_BACKWARD, 0)]
    vocab = _Action(1, VocabPass.VOCAB, 0)  # type: ignore[arg-type]
    spliced = splice_vocab_passes(lowered, [_Action(1, FORWARD, 0), vocab, _Action(1, FULL_BACKWARD, 0)])
    assert spliced == [lowered[0], lowered[1], lowered[2], vocab, lowered[3]]
    assert str(vocab) == "1VOCAB0"
    assert splice_vocab_passes(lowered[:2], [lowered[0], vocab]) == [*lowered[:2], vocab]  # a pass at the end


@pytest.mark.parametrize("vocab, pp", [(256, 2), (258, 4), (50257, 8), (5, 4)])
def test_each_pp_rank_holds_the_rows_dtensor_shard_gives_it(vocab, pp):
    ranges = [vocab_range(vocab, pp, r) for r in range(pp)]
    chunks = torch.arange(vocab).chunk(pp)  # DTensor's Shard(0) split (torch.chunk), empty ranks at the end
    for rank, (start, end) in enumerate(ranges):
        piece = chunks[rank] if rank < len(chunks) else torch.empty(0)
        assert end - start == len(piece)
        assert piece.tolist() == list(range(start, end))
    assert ranges[0][0] == 0 and ranges[-1][1] == vocab


def plan(**fields) -> Plan:
    return Plan(model=fields.pop("model", PRESETS["tiny"]), cluster=parse_cluster("1x4xcpu"),
                train=TrainSpec(seq_len=32, global_batch=8, dtype="fp32"), vocab_parallel=True, **fields)


def test_refusals_name_the_flag():
    with pytest.raises(SpecError, match="--vocab-parallel=True: with learned position embeddings"):
        check_vocab_parallel_runnable(plan(model=PRESETS["tiny-gpt"], pp=2, tp=2))
    check_vocab_parallel_runnable(plan(model=PRESETS["tiny-gpt"], pp=2, dp=2))  # tp 1: runs
    with pytest.raises(SpecError, match="needs pp > 1"):
        plan(dp=4)


@pytest.mark.parametrize("argv, words", [
    ("train --nproc 2 --vocab-parallel", "error: plan.vocab_parallel=True: splits the vocabulary over the pp ranks"),
    ("train --nproc 4 --pp 2 --vocab-parallel --dp-sync diloco --diloco-groups 2",
     "error: --vocab-parallel=True: runs with --dp-sync"),
    ("dryrun --pp 2 --vocab-parallel", "error: --vocab-parallel=True: the dry run does not build"),
])
def test_the_cli_refuses_in_one_line(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv.split()) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(words), err
