"""The simulator's schedule orders are the orders torch.distributed.pipelining executes (torch 2.13).

Single-stage schedules (GPipe, 1F1B) are run for real: their `_step_microbatches` loop drives a mocked stage
that records each forward_one_chunk/backward_one_chunk call, with no processes and no tensors. Multi-stage
schedules execute `pipeline_order_with_comms[rank]` action by action; we read its compute actions.
"""

from __future__ import annotations

from unittest import mock

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.pipelining import schedules as torch_schedules  # noqa: E402
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping  # noqa: E402
from torch.distributed.pipelining.stage import PipelineStage  # noqa: E402

from fivefold.errors import SpecError  # noqa: E402
from fivefold.cost.schedules import TORCH_SCHEDULE_CLASS, rank_orders, stage_owners  # noqa: E402
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster  # noqa: E402


def _mock_stage(pp: int, rank: int, num_stages: int):
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.num_stages = rank, pp, num_stages
    stage.stage_index, stage.is_last, stage.submod = rank, rank == num_stages - 1, None
    for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
        getattr(stage, name).return_value = []
    return stage


def executed_single(schedule: str, pp: int, micro_batches: int) -> list[list[str]]:
    """What ScheduleGPipe / Schedule1F1B really run on each rank, recorded from their step loop."""
    cls = getattr(torch_schedules, TORCH_SCHEDULE_CLASS[schedule])
    orders = []
    for rank in range(pp):
        log: list[str] = []
        stage = _mock_stage(pp, rank, pp)
        stage.forward_one_chunk.side_effect = lambda i, *a, _r=rank, **k: log.append(f"{_r}F{i}")
        stage.backward_one_chunk.side_effect = lambda i, *a, _r=rank, **k: log.append(f"{_r}B{i}")
        runner = cls(stage, micro_batches, loss_fn=lambda output, target: None)
        for name in ("_initialize_stage", "_maybe_compute_loss", "_maybe_get_loss", "_update_losses"):
            setattr(runner, name, lambda *a, **k: None)
        runner._step_microbatches([()] * micro_batches, [{}] * micro_batches)
        orders.append(log)
    return orders


def executed_multi(schedule: str, pp: int, local_stages: int, micro_batches: int) -> list[list[str]]:
    """The compute actions of torch's lowered per-rank program (what its runtime loop iterates)."""
    cls = getattr(torch_schedules, TORCH_SCHEDULE_CLASS[schedule])
    stage = _mock_stage(pp, 0, pp * local_stages)
    runner = cls([stage] * local_stages, micro_batches)
    return [[str(a) for a in runner.pipeline_order_with_comms[rank] if a.is_compute_op] for rank in range(pp)]


def ours(schedule: str, pp: int, local_stages: int, micro_batches: int) -> list[list[str]]:
    return [[str(a) for a in actions] for actions in rank_orders(schedule, pp, local_stages, micro_batches)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,micro_batches", [(1, 3), (2, 2), (2, 5), (4, 4), (4, 8), (4, 11), (8, 8), (8, 16)])
def test_single_stage_orders_match_torch(schedule: str, pp: int, micro_batches: int) -> None:
    assert ours(schedule, pp, 1, micro_batches) == executed_single(schedule, pp, micro_batches)


@pytest.mark.parametrize("schedule,local_stages", [("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                                   ("zb-h1", 1), ("zbv", 2)])
@pytest.mark.parametrize("pp,micro_batches", [(1, 4), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8),
                                              (8, 24), (4, 3), (8, 4)])
def test_multi_stage_orders_match_torch(schedule: str, local_stages: int, pp: int, micro_batches: int) -> None:
    assert ours(schedule, pp, local_stages, micro_batches) == executed_multi(schedule, pp, local_stages,
                                                                             micro_batches)


def test_torch_1f1b_drawing_aid_is_not_what_runs() -> None:
    """Why we record the 1F1B loop: torch 2.13's Schedule1F1B.pipeline_order starts the last rank at F1."""
    stage = _mock_stage(4, 0, 4)
    drawn = [str(a) for a in torch_schedules.Schedule1F1B(stage, 8).pipeline_order[3] if a is not None]
    assert drawn[0] == "3F1"
    assert ours("1f1b", 4, 1, 8)[3][:3] == executed_single("1f1b", 4, 8)[3][:3] == ["3F0", "3B0", "3F1"]


@pytest.mark.parametrize("schedule,local_stages,style", [("interleaved-1f1b", 2, "loop"),
                                                         ("interleaved-1f1b", 4, "loop"), ("zbv", 2, "v")])
def test_stage_owners_match_torch_and_plan(schedule: str, local_stages: int, style: str) -> None:
    pp = 2
    owners = stage_owners(rank_orders(schedule, pp, local_stages, 4))
    assert owners == generate_stage_to_rank_mapping(pp, pp * local_stages, style=style)
    plan = Plan(model=PRESETS["tiny"].__class__(**{**PRESETS["tiny"].__dict__, "layers": 8}),
                cluster=parse_cluster("1x2xcpu"), train=TrainSpec(global_batch=4, dtype="fp32"), dp=1, pp=pp,
                schedule=schedule, virtual_stages=local_stages)
    assert owners == {stage: plan.stage_owner(stage) for stage in range(plan.num_stages)}


def test_every_micro_batch_runs_each_pass_once() -> None:
    for schedule, local_stages, split in (("1f1b", 1, False), ("interleaved-1f1b", 2, False), ("zbv", 2, True)):
        orders = rank_orders(schedule, 4, local_stages, 8)
        kinds = ("F", "I", "W") if split else ("F", "B")
        flat = sorted(str(a) for actions in orders for a in actions)
        expected = sorted(f"{s}{k}{m}" for s in range(4 * local_stages) for k in kinds for m in range(8))
        assert flat == expected


def test_bad_schedule_arguments_are_one_line_errors() -> None:
    with pytest.raises(SpecError, match="schedule='pipedream'"):
        rank_orders("pipedream", 2, 1, 4)
    with pytest.raises(SpecError, match="zbv uses 2"):
        rank_orders("zbv", 2, 3, 4)
    with pytest.raises(SpecError, match="rounds"):  # torch refuses it too
        rank_orders("zb-h1", 2, 1, 5)
