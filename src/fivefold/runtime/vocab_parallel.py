"""Vocabulary parallelism (Yeung et al. 2024, "Balancing Pipeline Parallelism with Vocabulary Parallelism",
arXiv 2411.05288): the input embedding, the output layer and the cross-entropy split by vocabulary over the pp
ranks of each pipeline, so the last stage no longer carries the whole head alone.

What runs where (`--vocab-parallel`, pp ranks r = 0..pp-1, vocabulary rows [start_r, end_r), ceil(V/pp) each):
- every pp rank holds rows start_r..end_r of `tok_embeddings.weight` and of `output.weight`, as DTensors
  sharded (Shard(0)) over the pp mesh dim, so checkpoints keep the global [V, hidden] names and shapes and DCP
  reshards them to and from plain plans;
- embedding, before the schedule: each pp rank looks up the tokens of its rows (zero for the others) for all of
  its replica's rows; a sum-reduce over the pp group lands the embedding on the rank of stage 0, which feeds
  it to the schedule. After the schedule, stage 0's input gradients are broadcast over the pp group and each
  rank adds them into its rows (the paper's embedding split, done outside the schedule);
- output layer and loss, one vocabulary pass V per micro-batch inside the schedule, at the same point of every
  rank's action list: the last stage's normed hidden states are broadcast over the pp group; each rank computes
  its [tokens, V/pp] logits, the max is all-reduced, then (sum of exp, target logit) in one all-reduce; each
  rank computes its softmax slice, its head gradient, and its share of the hidden-state gradient, which a
  sum-reduce brings to the last stage for its backward. No rank ever holds full-vocabulary logits.
  Per micro-batch of T tokens (this rank's part of the sequence) over the pp group: a broadcast of T x hidden,
  an all-reduce of T (max) and of 2T (sums), a reduce of T x hidden; per step, a reduce and a broadcast of the
  replica's embedding (rows x seq x hidden) and an all-reduce of the slices' gradients over dp x cp (x tp
  under sequence parallel), which saw other tokens. The paper's S and T passes overlap these with compute; here the pass is one blocking action.

Placement of the V passes: collectives over the pp group must come in the same order on every rank, so the V
pass of micro-batch i goes into every rank's list where a dependency-driven walk of the compute-only schedule
stands when the last stage has finished its forward of i (insert_vocab_passes). The walk is a valid execution
of the lists with V as a barrier, so the lists cannot deadlock. The passes use a process group of their own,
so they never queue behind the schedule's point-to-point traffic.
"""

from __future__ import annotations

import functools
import math
from enum import Enum

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD,
                                                    _Action, _PipelineScheduleRuntime)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Replicate

from fivefold.errors import require
from fivefold.models import Transformer, build_model, init_weights
from fivefold.spec import Plan

VOCAB_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")  # all of fivefold's schedules


class VocabPass(str, Enum):
    """The action type of a vocabulary pass in torch's action lists (`.value` is what its repr prints)."""

    VOCAB = "VOCAB"


def check_vocab_parallel_runnable(plan: Plan) -> None:
    """One SpecError line for a vocabulary-parallel plan the runtime cannot run."""
    if not plan.vocab_parallel:
        return
    require(plan.schedule in VOCAB_SCHEDULES, "--vocab-parallel", True,
            f"runs with --schedule {', '.join(VOCAB_SCHEDULES)}; not {plan.schedule}")
    require(not plan.model.is_moe, "--vocab-parallel", True,
            f"is not built for mixture-of-experts models yet ({plan.model.name}); leave it out")
    require(not (plan.model.position == "learned" and plan.tp > 1), "--vocab-parallel", True,
            "with learned position embeddings (GPT style) runs with tp=1 only")
    require(plan.model.vocab >= plan.pp, "--vocab-parallel", True,
            f"needs at least one vocabulary row per pp rank (vocab {plan.model.vocab}, pp {plan.pp})")


def vocab_range(vocab: int, pp: int, pp_rank: int) -> tuple[int, int]:
    """The rows [start, end) pp rank `pp_rank` holds: ceil(vocab/pp) each, the last ones fewer when pp does not
    divide the vocabulary (DTensor's Shard(0) split, torch.chunk's rule), so no padding and no refusal."""
    chunk = math.ceil(vocab / pp)
    start = min(pp_rank * chunk, vocab)
    return start, min(start + chunk, vocab)


def build_vocab_slices(plan: Plan, pp_mesh, device: torch.device, seed: int) -> Transformer:
    """A Transformer holding only tok_embeddings and output, each sharded by rows over the pp mesh dim and
    initialised from (seed, name) like every other weight, so the slices are rows of the plain model's."""
    model = build_model(plan.model, device="meta")
    for key in list(model.layers.keys()):
        del model.layers[key]
    model.pos_embeddings = None
    model.norm = None
    parallelize_module(model, pp_mesh, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                                        "output": ColwiseParallel()})
    model.to_empty(device=device)
    init_weights(model, seed)
    return model


class _HeadLoss(torch.autograd.Function):
    """The last stage's loss node: its value is filled in by the vocabulary pass, and its backward hands the
    stage the hidden-state gradient that pass reduced."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, vocab: "VocabParallel", index: int) -> torch.Tensor:
        ctx.vocab, ctx.index = vocab, index
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.vocab.grad_hidden.pop(ctx.index) * grad, None, None


class VocabParallel:
    """One rank's share of the embedding, the head and the loss (see the module docstring)."""

    def __init__(self, plan: Plan, coords: dict[str, int], slices: Transformer, global_tokens: int,
                 vocab_group: dist.ProcessGroup, grad_group: dist.ProcessGroup | None,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        self.plan, self.slices, self.global_tokens = plan, slices, global_tokens
        self.group, self.grad_group, self.tp_group = vocab_group, grad_group, tp_group
        owner = functools.partial(plan.rank_of, dp=coords["dp"], cp=coords["cp"], tp=coords["tp"])
        self.first_rank = owner(pp=plan.stage_owner(0))
        self.last_rank = owner(pp=plan.stage_owner(plan.num_stages - 1))
        self.rank = owner(pp=coords["pp"])
        self.start, self.end = vocab_range(plan.model.vocab, plan.pp, coords["pp"])
        self.embedding = slices.tok_embeddings.weight
        self.head = slices.output.weight
        assert self.embedding.to_local().shape[0] == self.end - self.start, "DTensor split differs from vocab_range"
        # Under sequence parallel each tp rank holds a slice of the sequence; otherwise the tp ranks repeat it.
        self.sequence_slice = (coords["tp"], plan.tp) if plan.tp > 1 and plan.sequence_parallel else None
        self.inferring = False  # torch's first-step shape inference: no real micro-batch
        self.targets: list[torch.Tensor] = []

    # --- the stage hooks -------------------------------------------------------------------------
    def attach(self, parts: dict[int, nn.Module], schedule: _PipelineScheduleRuntime) -> None:
        """Catch stage 0's input gradients, and mark torch's shape inference (it runs the stages and the loss
        once on the first step) so that it touches no micro-batch state."""
        if 0 in parts:
            parts[0].register_forward_pre_hook(self._catch_input_gradient)
        initialize = schedule._initialize_pp_stages

        def initialize_quietly(*args, **kwargs):
            self.inferring = True
            try:
                return initialize(*args, **kwargs)
            finally:
                self.inferring = False

        schedule._initialize_pp_stages = initialize_quietly  # type: ignore[method-assign]
        schedule._comp_type_to_function_map[VocabPass.VOCAB] = self.vocab_pass  # type: ignore[index]

    def _catch_input_gradient(self, module: nn.Module, args: tuple) -> tuple | None:
        if self.inferring or not torch.is_grad_enabled():
            return None
        index = self.forwards
        self.forwards += 1
        embedded = args[0].detach().requires_grad_(True)
        embedded.register_hook(functools.partial(self.input_grads.__setitem__, index))
        return (embedded, *args[1:])

    def loss_fn(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss_fn: keeps the normed hidden states for the vocabulary pass."""
        if self.inferring:
            return (hidden * 0).sum()
        index = self.losses
        self.losses += 1
        self.hidden[index] = hidden.detach()
        return _HeadLoss.apply(hidden, self, index)

    # --- one step --------------------------------------------------------------------------------
    def columns(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the sequence (its sequence-parallel slice, else all of it)."""
        if self.sequence_slice is None:
            return x
        index, parts = self.sequence_slice
        return x.chunk(parts, dim=1)[index]

    def begin(self, inputs: torch.Tensor, targets: torch.Tensor, micro_batch: int) -> torch.Tensor | None:
        """Start a step: the embedding of this replica's rows (on the rank of stage 0; None elsewhere)."""
        self.targets = list(self.columns(targets).split(micro_batch))
        self.forwards = self.losses = 0
        self.hidden: dict[int, torch.Tensor] = {}
        self.grad_hidden: dict[int, torch.Tensor] = {}
        self.input_grads: dict[int, torch.Tensor] = {}
        self.loss = torch.zeros((), dtype=torch.float32, device=inputs.device)
        table = self.embedding.to_local()
        self.grad_embedding = torch.zeros_like(table)
        self.grad_head = torch.zeros_like(self.head.to_local())
        self.ids = self.columns(inputs)
        rows, inside = self._local_rows(self.ids)
        with torch.no_grad():
            embedded = F.embedding(rows, table) * inside.unsqueeze(-1).to(table.dtype)
        dist.reduce(embedded, dst=self.first_rank, group=self.group)
        return embedded if self.rank == self.first_rank else None

    def _local_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inside = (ids >= self.start) & (ids < self.end)
        return (ids - self.start).clamp(0, self.end - self.start - 1), inside

    @torch.no_grad()
    def vocab_pass(self, action: _Action, ctx: object = None) -> None:
        """Micro-batch `action.microbatch_index` through this rank's vocabulary rows (module docstring)."""
        index = action.microbatch_index
        assert index is not None
        targets = self.targets[index].reshape(-1)
        weight = self.head.to_local()
        if self.rank == self.last_rank:
            hidden = self.hidden.pop(index).to(weight.dtype).contiguous()
        else:
            hidden = weight.new_empty(*self.targets[index].shape, weight.shape[1])
        dist.broadcast(hidden, src=self.last_rank, group=self.group)
        flat = hidden.reshape(-1, weight.shape[1])
        logits = (flat @ weight.t()).float()
        peak = logits.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        exps = (logits - peak.unsqueeze(-1)).exp_()
        rows, inside = self._local_rows(targets)
        target_logit = logits.gather(1, rows.unsqueeze(-1)).squeeze(-1) * inside
        sums = torch.stack([exps.sum(dim=-1), target_logit])
        dist.all_reduce(sums, group=self.group)
        total, target_logit = sums[0], sums[1]
        if self.rank == self.last_rank:
            self.loss += (total.log() + peak - target_logit).sum() / self.global_tokens
        grad_logits = exps.div_(total.unsqueeze(-1))
        hit = inside.nonzero().squeeze(-1)
        grad_logits[hit, rows[hit]] -= 1.0
        grad_logits.div_(self.global_tokens)
        grad_logits = grad_logits.to(weight.dtype)
        grad_hidden = grad_logits @ weight
        dist.reduce(grad_hidden, dst=self.last_rank, group=self.group)
        if self.rank == self.last_rank:
            self.grad_hidden[index] = grad_hidden.view_as(hidden)
        self.grad_head += grad_logits.t() @ flat

    def finish(self, micro_batches: int) -> torch.Tensor | None:
        """End a step: the embedding rows' gradients from stage 0's input gradients, the slices' gradients summed
        over the ranks that saw other tokens, set as DTensor gradients; the step's loss on the last stage."""
        table = self.embedding.to_local()
        if self.rank == self.first_rank:
            assert sorted(self.input_grads) == list(range(micro_batches)), sorted(self.input_grads)
            grad = torch.cat([self.input_grads[i] for i in range(micro_batches)]).to(table.dtype).contiguous()
        else:
            grad = table.new_empty(*self.ids.shape, table.shape[1])
        dist.broadcast(grad, src=self.first_rank, group=self.group)
        rows, inside = self._local_rows(self.ids)
        self.grad_embedding.index_add_(0, rows[inside], grad[inside])
        for param, local in ((self.embedding, self.grad_embedding), (self.head, self.grad_head)):
            if self.grad_group is not None:
                dist.all_reduce(local, group=self.grad_group)
            param.grad = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                            stride=param.stride())
        assert not self.hidden and not self.grad_hidden, "a micro-batch missed its vocabulary pass"
        if self.rank != self.last_rank:
            return None
        if self.sequence_slice is not None:  # each tp rank has its slice's loss; the step reports tp rank 0's
            dist.all_reduce(self.loss, group=self.tp_group)
        return self.loss


def vocab_schedule(schedule_class: type, stages: list, micro_batches: int, vocab: VocabParallel
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
    num_stages = stages[0].num_stages
    with_passes = insert_vocab_passes({rank: [a for a in actions if a is not None] for rank, actions in order.items()},
                                      num_stages - 1, micro_batches)
    schedule.pipeline_order_with_comms = {rank: splice_vocab_passes(actions, with_passes[rank])
                                          for rank, actions in schedule.pipeline_order_with_comms.items()}
    vocab.attach({stage.stage_index: stage.submod for stage in stages}, schedule)
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


def build_vocab_parallel(plan: Plan, mesh, seed: int, global_tokens: int) -> VocabParallel:
    """This rank's vocabulary slices and the two process groups they talk over (created on every rank, in the
    same order): the pp ranks of its pipeline, and the ranks whose slices saw other tokens (dp x cp, and tp under
    sequence parallel), which sum the slices' gradients."""
    slices = build_vocab_slices(plan, mesh["pp"], mesh.device, seed)
    sequence_split = plan.tp > 1 and plan.sequence_parallel
    pipelines, replicas = [], {}
    for rank in range(plan.world_size):
        coords = plan.coords(rank)
        if coords["pp"] == 0:
            pipelines.append(plan.group_ranks("pp", rank))
        key = (coords["pp"], 0 if sequence_split else coords["tp"])
        replicas.setdefault(key, []).append(rank)
    vocab_group, _ = dist.new_subgroups_by_enumeration(pipelines)
    grad_group = None
    if plan.dp * plan.cp * (plan.tp if sequence_split else 1) > 1:
        grad_group, _ = dist.new_subgroups_by_enumeration(list(replicas.values()))
    return VocabParallel(plan, mesh.coords, slices, global_tokens, vocab_group, grad_group,
                         mesh.group("tp") if sequence_split else None)
