"""Validation loss (`--eval-data`, `--eval-every N`, `--eval-batches K`): the forward without gradients under
the plan's own layout, on the same K global batches at every evaluation and under every plan.

Each evaluation draws the first K global batches of a fresh loader over the validation data (seeded by the
run's seed), so every plan and every evaluation of a run sees the same tokens in the same order. Each rank runs
the forward of its rows as a training step would (its replica's micro-batches, its cp columns, its tp shards;
a pipeline through the schedule's forward-only `eval`), with the same loss normalisation (summed cross-entropy
over the global batch's target tokens), and one all-reduce per batch adds the shares (runtime/bookkeeping.py).
eval_loss is the mean over the K batches, eval_perplexity its exponential. With DiLoCo each outer group
evaluates its rows with its own weights, normalised by its own tokens (as in training), so the groups' shares
are averaged: at a sync step every group holds the outer weights and this is their loss on the whole batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fivefold.data.loader import GlobalBatchLoader
from fivefold.runtime.bookkeeping import reduce_step_totals
from fivefold.runtime.context_parallel import shard_batch, split_micro_batches
from fivefold.runtime.pipeline import run_schedule


class Evaluator:
    """Rank-local view of the validation data; `due(step)` says when, `evaluate(...)` measures."""

    def __init__(self, config: Any, dataset: Any, seq_len: int, global_batch: int) -> None:
        self.every = config.eval_every
        self.batches = config.eval_batches
        self.last_step = config.steps
        self.loader_args = (dataset, seq_len, global_batch, config.seed)

    @classmethod
    def for_run(cls, config: Any, plan: Any) -> Evaluator | None:
        """None when the run has no --eval-data."""
        if not config.eval_data:
            return None
        from fivefold.data import load_tokenizer, open_data

        dataset = open_data(config.eval_data, load_tokenizer(config.tokenizer), config.text_field)
        return cls(config, dataset, plan.train.seq_len, plan.train.global_batch)

    def due(self, step: int) -> bool:
        """Whether 1-based step `step` evaluates: every N steps, and always after the last."""
        return step == self.last_step or (self.every > 0 and step % self.every == 0)

    @torch.no_grad()
    def evaluate(self, model: Any, rows: slice, cp_rank: int, tp_rank: int,
                 end_of_document: int | None, outer_groups: int = 1) -> dict[str, float]:
        """{"eval_loss", "eval_perplexity"} of the current weights, the same on every rank."""
        loader = GlobalBatchLoader(*self.loader_args)
        total = 0.0
        for _ in range(self.batches):
            batch = loader.next_batch()[rows].to(model.device, non_blocking=True)
            inputs, targets, extra = shard_batch(model.plan, cp_rank, batch[:, :-1], batch[:, 1:], end_of_document)
            local = forward_loss(model, inputs, targets, extra)
            zero = torch.zeros((), dtype=torch.float64, device=model.device)
            total += reduce_step_totals(zero, local, model.plan, tp_rank, request_metrics=False,
                                        outer_groups=outer_groups).loss
        forget_router_stats(model.parts)
        loss = total / self.batches
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}


def forward_loss(model: Any, inputs: torch.Tensor, targets: torch.Tensor,
                 extra: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """This rank's share of the loss of its rows, forward only (zero on pipeline ranks without the last stage)."""
    plan = model.plan
    with model.autocast:
        if model.vocab is not None:  # --vocab-parallel: the vocabulary passes compute the loss, no gradients
            embedded = model.vocab.begin(inputs, targets, plan.micro_batch, training=False)
            run_schedule(model.schedule, plan, list(model.parts), embedded, targets, extra, forward_only=True)
            local = model.vocab.finish(model.micro_batches)
            return local if local is not None else torch.zeros((), device=model.device)
        if model.schedule is not None:
            local = run_schedule(model.schedule, plan, list(model.parts), inputs, targets, extra, forward_only=True)
            return local if local is not None else torch.zeros((), device=model.device)
        whole = model.ddp or model.parts[0]
        mb_extras = split_micro_batches(extra or {}, plan.micro_batch)
        local = torch.zeros((), device=model.device)
        for index, (mb_inputs, mb_targets) in enumerate(zip(inputs.split(plan.micro_batch),
                                                            targets.split(plan.micro_batch))):
            logits = whole(mb_inputs, **(mb_extras[index] if mb_extras else {}))
            local += model.loss_fn(logits, mb_targets)
    return local


def forget_router_stats(parts: dict[int, torch.nn.Module]) -> None:
    """MoE layers count their routing during any forward; the evaluation's counts must not reach the next
    training step's metrics or its auxiliary-loss-free bias update."""
    for part in parts.values():
        for module in part.modules():
            if hasattr(module, "take_stats"):
                module.take_stats()
