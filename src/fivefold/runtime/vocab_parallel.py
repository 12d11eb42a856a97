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
  under sequence parallel), which saw other tokens. The paper's S and T passes overlap these with compute;
  here the pass is one blocking action.

Placement of the V passes in each rank's action list: runtime/vocab_schedule.py. The passes use a process group
of their own, so they never queue behind the schedule's point-to-point traffic.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Replicate

from fivefold.errors import require
from fivefold.models import Transformer, build_model, init_weights
from fivefold.runtime.vocab_schedule import VocabPass
from fivefold.spec import Plan

VOCAB_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")  # all of fivefold's schedules

def check_vocab_parallel_runnable(plan: Plan) -> None:
    """One SpecError line for a vocabulary-parallel plan the runtime cannot run."""
    if not plan.vocab_parallel:
        return
    require(plan.schedule in VOCAB_SCHEDULES, "--vocab-parallel", True,
            f"runs with --schedule {', '.join(VOCAB_SCHEDULES)}; not {plan.schedule}")
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
        ctx.vocab, ctx.index, ctx.dtype = vocab, index, hidden.dtype
        return hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (ctx.vocab.grad_hidden.pop(ctx.index) * grad).to(ctx.dtype), None, None


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
    def attach(self, parts: dict[int, nn.Module], schedule: _PipelineScheduleRuntime,
               action_lists: dict[bool, dict[int, list[_Action]]]) -> None:
        """Catch stage 0's input gradients, and mark torch's shape inference (it runs the stages and the loss
        once on the first step) so that it touches no micro-batch state. `action_lists`: the schedule's lists
        with the vocabulary passes, for training (True) and for the forward-only pass (False)."""
        self.schedule, self.action_lists = schedule, action_lists
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

    def begin(self, inputs: torch.Tensor, targets: torch.Tensor, micro_batch: int, training: bool = True
              ) -> torch.Tensor | None:
        """Start a step (`training`) or a forward-only pass (validation): the embedding of this replica's rows
        (on the rank of stage 0; None elsewhere)."""
        self.training = training
        self.schedule.pipeline_order_with_comms = self.action_lists[training]
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
        if not self.training:
            return
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
        if self.training:
            self._set_gradients(micro_batches)
        assert not self.hidden and not self.grad_hidden, "a micro-batch missed its vocabulary pass"
        if self.rank != self.last_rank:
            return None
        if self.sequence_slice is not None:  # each tp rank has its slice's loss; the step reports tp rank 0's
            dist.all_reduce(self.loss, group=self.tp_group)
        return self.loss

    def _set_gradients(self, micro_batches: int) -> None:
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
