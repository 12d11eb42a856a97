"""Pipeline parallelism with torch.distributed.pipelining: stage models cut from the plan's layers per
stage, one PipelineStage per virtual stage this rank owns, and the plan's schedule.

Schedules (torch class):
    gpipe            ScheduleGPipe
    1f1b             Schedule1F1B
    interleaved-1f1b ScheduleInterleaved1F1B (virtual stages looped over ranks: stage s on rank s % pp)
    zb-h1            ScheduleInterleavedZeroBubble with one stage per rank: 1F1B with the backward split
                     into input- and weight-gradient passes, rank r deferring r weight passes into the
                     cooldown bubble, which is ZB-H1 of Qi et al. 2024 (same memory as 1F1B)
    zbv              ScheduleZBVZeroBubble (two stages per rank in a V: stage s and 2*pp-1-s)
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.pipelining.schedules import _PipelineSchedule

from fivefold.models import Transformer, build_model
from fivefold.runtime.vocab_parallel import VocabParallel
from fivefold.runtime.vocab_schedule import BACKWARD_ACTIONS, vocab_schedule
from fivefold.spec import Plan

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # PipelineScheduleSingle: one stage object, not a list


def stage_layers(plan: Plan, stage: int) -> range:
    """The global layer indices of virtual stage `stage` (plan.layers_per_stage in model order)."""
    first = sum(plan.layers_per_stage[:stage])
    return range(first, first + plan.layers_per_stage[stage])


def build_stage_model(plan: Plan, stage: int) -> Transformer:
    """The whole model on meta, less what `stage` does not own. Names of what stays do not change, so
    seeded init and checkpoints address the same tensors under every plan."""
    model = build_model(plan.model, device="meta")
    if plan.num_stages == 1:
        return model
    keep = {str(i) for i in stage_layers(plan, stage)}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    if stage != 0:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if stage != plan.num_stages - 1:
        model.norm = None
        model.output = None
    if plan.vocab_parallel:  # the token embedding and the head are split over the pp ranks (vocab_parallel.py)
        model.tok_embeddings = None
        model.output = None
    # A later stage receives hidden states that sequence parallel may have split along the sequence,
    # so the model cannot count positions from its input; give it the whole sequence's positions.
    model.register_forward_pre_hook(_positions_of_whole_sequence(plan.train.seq_len), with_kwargs=True)
    return model


def _positions_of_whole_sequence(seq_len: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("positions") is None:
            kwargs = {**kwargs, "positions": torch.arange(seq_len, device=args[0].device)}
        return args, kwargs
    return hook


def build_schedule(plan: Plan, stage_models: dict[int, nn.Module], pp_group: torch.distributed.ProcessGroup,
                   device: torch.device, micro_batches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   vocab: VocabParallel | None = None) -> _PipelineSchedule:
    """A schedule over this rank's stages. `loss_fn` is already normalised by the global token count,
    so gradients are summed over micro-batches (scale_grads=False), never averaged. With `vocab`
    (--vocab-parallel) the loss is its vocabulary passes, placed in torch's action lists."""
    stages = [PipelineStage(module, stage_index=index, num_stages=plan.num_stages, device=device, group=pp_group)
              for index, module in sorted(stage_models.items())]
    schedule_class = SCHEDULE_CLASSES[plan.schedule]
    if vocab is not None:
        return vocab_schedule(schedule_class, stages, micro_batches, vocab)
    if plan.schedule in SINGLE_STAGE_SCHEDULES:
        return schedule_class(stages[0], n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
    return schedule_class(stages, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)


@contextlib.contextmanager
def forward_actions_only(schedule: _PipelineSchedule) -> Iterator[None]:
    """An action-list schedule without its backward actions while it runs forward-only: torch 2.13 keeps them in
    the lists under eval(), and zbv's adjacent stages on one rank then fail ("can't steal_bwd_input if this stage
    doesn't have backward")."""
    lists = getattr(schedule, "pipeline_order_with_comms", None)
    if lists is None:  # GPipe and 1F1B run their own loops
        yield
        return
    schedule.pipeline_order_with_comms = {rank: [a for a in actions if a.computation_type not in BACKWARD_ACTIONS]
                                          for rank, actions in lists.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = lists


def run_schedule(schedule: _PipelineSchedule, plan: Plan, own_stages: list[int], inputs: torch.Tensor,
                 targets: torch.Tensor, extra: dict[str, torch.Tensor] | None = None,
                 forward_only: bool = False) -> torch.Tensor | None:
    """One pipelined forward+backward over this replica's rows (`forward_only`: the schedule's forward-only
    `eval`, for validation); the sum of the micro-batch losses when this rank holds the last stage, else None.
    `extra` (positions, document ids [rows, seq]) goes to every stage, split into micro-batches by rows like
    the tokens."""
    holds_first = 0 in own_stages
    holds_last = plan.num_stages - 1 in own_stages
    losses: list[torch.Tensor] = []
    args = (inputs,) if holds_first else ()
    if forward_only:
        with forward_actions_only(schedule):
            schedule.eval(*args, target=targets if holds_last else None, losses=losses if holds_last else None,
                          **(extra or {}))
    else:
        schedule.step(*args, target=targets if holds_last else None, losses=losses if holds_last else None,
                      return_outputs=False, **(extra or {}))
    if not holds_last:
        return None
    return torch.stack([loss.detach() for loss in losses]).sum()
