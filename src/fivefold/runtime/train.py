"""The training loop of one worker process: any plan, read top to bottom.

build the mesh -> build this rank's stage model(s): TP -> activation checkpointing -> DP/ZeRO ->
to_empty + seeded init -> for each step: the global batch, this replica's rows, forward_backward
(pipelined, or micro-batch by micro-batch with gradient accumulation), clip by the global norm, AdamW,
the metrics record (metrics.StepMeter). The loss guard, stragglers, events, checkpoints and rollback sit
behind one object (elastic_run.ElasticRun); test-only fault knobs come in from outside (knobs.py).

The loss is the sum of token cross-entropies divided by the number of target tokens in the GLOBAL
batch, so summing over micro-batches, replicas and stages gives exactly the single-process loss and
gradients: every plan computes the same training run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.data.loader import GlobalBatchLoader
from fivefold.elastic.events import restart_count
from fivefold.elastic.restart import newest_complete, resume_point
from fivefold.interrupt import Interrupted, interrupted_line
from fivefold.models import init_weights
from fivefold.runtime.checkpointing import Checkpointer, StageModels, log_to
from fivefold.runtime.diloco import OuterLoop, inner_sync_bytes
from fivefold.runtime.config import RunConfig, check_gpu_dtype
from fivefold.runtime.context_parallel import (apply_context_parallel, data_parallel_mesh, positions_per_row,
                                               shard_batch, split_micro_batches)
from fivefold.runtime.elastic_run import ElasticRun
from fivefold.runtime.evaluate import Evaluator
from fivefold.runtime.expert_parallel import (CollapseWatch, describe_collapse, forget_metadata_inference,
                                              moe_step_metrics, prepare_moe, sequence_split, set_expert_gemm)
from fivefold.runtime.float8 import convert_to_float8
from fivefold.runtime.knobs import NO_KNOBS, FaultKnobs
from fivefold.runtime.mesh import Mesh, build_mesh, init_distributed, pick_device
from fivefold.runtime.metrics import MetricsFile, Progress, StepMeter, summarize
from fivefold.runtime.bookkeeping import gathers_metrics, reduce_step_totals
from fivefold.runtime.optim import build_optimizer, clip_to_norm, local_grad_norm_squared, set_lr
from fivefold.runtime.schedule import parse_betas
from fivefold.runtime.parallelize import (apply_activation_checkpointing, apply_compile, apply_data_parallel,
                                          apply_tensor_parallel, finish_gradient_sync, set_gradient_sync,
                                          uses_ddp, wrap_ddp)
from fivefold.runtime.pipeline import build_schedule, build_stage_model, run_schedule
from fivefold.runtime.preemption import TermWatch
from fivefold.runtime.profiling import StepProfiler
from fivefold.runtime.trace import BACKWARD, FORWARD, OPTIMIZER, StepTracer
from fivefold.runtime.vocab_parallel import VocabParallel, build_vocab_parallel
from fivefold.spec import Plan


class TokenCrossEntropy:
    """sum over tokens of cross-entropy / target tokens in the global batch."""

    def __init__(self, global_tokens: int) -> None:
        self.global_tokens = global_tokens

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return loss / self.global_tokens


def compute_dtype(plan: Plan, device: torch.device) -> torch.dtype | None:
    """bf16 mixed precision on a GPU when the plan trains in bf16; fp32 otherwise (always on CPU)."""
    if device.type != "cuda" or plan.train.dtype == "fp32":
        return None
    check_gpu_dtype(plan.train.dtype)
    return torch.bfloat16


def build_model_parts(plan: Plan, mesh: Mesh, seed: int, param_dtype: torch.dtype | None,
                      knobs: FaultKnobs = NO_KNOBS, compile_blocks: bool = False,
                      cpu_overlap: bool = False, fp8_recipe: str | None = None,
                      expert_gemm: str = "auto") -> dict[int, nn.Module]:
    """This rank's stage models, keyed by virtual stage index, parallelized and initialised. `cpu_overlap`
    (training on CPU): ZeRO-0 plain dp is left for DDP (train() wraps it after init) and ZeRO-1/2/3 reduce
    asynchronously (runtime/parallelize.py); the dry run keeps the GPU runtime's form. An fp8 plan's block
    linears become FP8 ones (`fp8_recipe`, default tensorwise; runtime/float8.py) before any parallelism;
    `expert_gemm`: how MoE experts run (models/moe.py)."""
    parts = {}
    moe_mesh = mesh.experts
    moe_tokens = sequence_split(plan, mesh.world) if plan.model.is_moe else None
    dp_mesh = data_parallel_mesh(mesh.world, plan) if plan.dp * plan.cp > 1 else None
    under_ddp = cpu_overlap and uses_ddp(plan, mesh.device)
    for stage in plan.stages_of(mesh.coords["pp"]):
        model = knobs.stage_model(build_stage_model(plan, stage), plan, mesh.rank)
        if plan.train.dtype == "fp8":
            convert_to_float8(model, fp8_recipe or "tensorwise", plan.tp)
        set_expert_gemm(model, expert_gemm)
        if plan.tp > 1:
            apply_tensor_parallel(model, mesh["tp"], plan.sequence_parallel, positions_per_row(plan))
        if plan.cp > 1:
            apply_context_parallel(model, mesh.group("cp"), plan.cp_method)
        apply_activation_checkpointing(model, plan.recompute)
        if compile_blocks:
            apply_compile(model)
        if plan.model.is_moe:
            # experts over ep x etp, tokens over tp, before dp wraps the blocks
            prepare_moe(model, plan, moe_mesh, param_dtype, under_ddp, moe_tokens)
        if dp_mesh is not None and not under_ddp:  # summed over dp x cp
            apply_data_parallel(model, dp_mesh, plan.zero, param_dtype, overlap_on_cpu=cpu_overlap)
        model.to_empty(device=mesh.device)
        init_weights(model, seed)
        model.train()
        parts[stage] = model
    return parts


def replica_rows(plan: Plan, dp_rank: int) -> slice:
    """The contiguous rows of the global batch that data-parallel replica `dp_rank` trains on."""
    rows = [plan.micro_batches_of_replica(r) * plan.micro_batch for r in range(plan.dp)]
    start = sum(rows[:dp_rank])
    return slice(start, start + rows[dp_rank])


def group_rows(plan: Plan, group: int, groups: int) -> int:
    """Rows of the global batch the dp replicas of outer group `group` train on (all rows with one group):
    each group's loss is the mean over its own tokens, so its gradient summed inside the group is its own."""
    block = plan.dp // groups
    return sum(plan.micro_batches_of_replica(r) * plan.micro_batch for r in range(group * block, (group + 1) * block))


def make_loader(config: RunConfig, plan: Plan) -> GlobalBatchLoader:
    from fivefold.data import load_tokenizer, open_data

    dataset = open_data(config.data, load_tokenizer(config.tokenizer), config.text_field)
    return GlobalBatchLoader(dataset, seq_len=plan.train.seq_len, global_batch=plan.train.global_batch,
                             seed=config.seed)


def end_of_document_of(config: RunConfig, loader) -> int:
    """The id that closes packed documents in this run's data (checked before launch: there is one)."""
    from fivefold.data import end_of_document_id, load_tokenizer

    found = end_of_document_id(loader.dataset, load_tokenizer(config.tokenizer))
    assert found is not None, "check_data refuses --document-mask without an end-of-document token"
    return found


@dataclass
class StepModel:
    """What one step's forward and backward run through on this rank."""

    plan: Plan
    device: torch.device
    parts: dict[int, nn.Module]  # this rank's stage models by virtual stage
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    micro_batches: int  # of this rank's replica
    schedule: Any  # the pipeline schedule (pp > 1), else None
    tracer: StepTracer
    autocast: Any  # bf16 autocast without FSDP's mixed precision, else a null context
    ddp: nn.Module | None = None  # parts[0] under DistributedDataParallel (parallelize.uses_ddp), else None
    vocab: VocabParallel | None = None  # --vocab-parallel: this rank's embedding and head rows, and the loss


def forward_backward(model: StepModel, inputs: torch.Tensor, targets: torch.Tensor,
                     extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Forward and backward of this replica's rows, micro-batch by micro-batch, gradients accumulated in the
    parameters: through the pipeline schedule, or in a plain loop whose last micro-batch syncs the gradients.
    `extra`: the model's keyword inputs per row (positions, document ids; context_parallel.shard_batch).
    This rank's share of the loss (zero on pipeline ranks without the last stage)."""
    plan = model.plan
    with model.autocast:
        if model.vocab is not None:
            embedded = model.vocab.begin(inputs, targets, plan.micro_batch)
            run_schedule(model.schedule, plan, list(model.parts), embedded, targets, extra)
            local_loss = model.vocab.finish(model.micro_batches)
            finish_gradient_sync(model.parts)
            return local_loss if local_loss is not None else torch.zeros((), device=model.device)
        if model.schedule is not None:
            local_loss = run_schedule(model.schedule, plan, list(model.parts), inputs, targets, extra)
            finish_gradient_sync(model.parts)
            return local_loss if local_loss is not None else torch.zeros((), device=model.device)
        local_loss = torch.zeros((), device=model.device)
        whole = model.ddp or model.parts[0]
        mb_extras = split_micro_batches(extra or {}, plan.micro_batch)
        for index, (mb_inputs, mb_targets) in enumerate(zip(inputs.split(plan.micro_batch),
                                                            targets.split(plan.micro_batch))):
            set_gradient_sync(whole, plan.zero, index, model.micro_batches)
            with model.tracer.span(FORWARD, 0, index):
                loss = model.loss_fn(whole(mb_inputs, **(mb_extras[index] if mb_extras else {})), mb_targets)
            with model.tracer.span(BACKWARD, 0, index):
                loss.backward()
            local_loss += loss.detach()
    finish_gradient_sync(model.parts)  # the asynchronous reductions, before anything reads a gradient
    return local_loss


def train(config: RunConfig, knobs: FaultKnobs = NO_KNOBS) -> dict:
    """Run `config.steps` steps of the plan on this process's rank; rank 0 returns the summary. SIGTERM stops
    every rank after the step it came in, with the work saved (runtime/preemption.py): Interrupted."""
    watch = TermWatch().install()
    try:
        return train_steps(config, knobs, watch)
    finally:
        watch.restore()


def train_steps(config: RunConfig, knobs: FaultKnobs, watch: TermWatch) -> dict:
    started = time.time()
    restart = restart_count()  # > 0: the elastic agent restarted us after a failure; continue from the newest checkpoint
    config = dataclasses.replace(config, resume_from=resume_point(config.checkpoint_dir, config.resume_from, restart))
    plan = config.plan
    # nn.Linear on [batch, seq, hidden] returns a reshaped view, which FSDP2 flags in case someone
    # modifies it in place; the logits are only read by the loss.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    device = pick_device(config.device, plan)
    init_distributed(device, config.collective_timeout)
    diloco = config.diloco(plan)  # None: gradients summed over the whole dp every step
    groups = diloco.groups if diloco else 1
    mesh = build_mesh(plan, device, groups)
    is_rank0 = mesh.rank == 0
    stream = sys.stderr if config.progress_to_stderr else sys.stdout
    log = log_to(stream) if is_rank0 else None
    elastic = ElasticRun(config, plan, mesh, restart, log, started)

    param_dtype = compute_dtype(plan, device)
    parts = build_model_parts(plan, mesh, config.seed, param_dtype, knobs, config.compile,
                              cpu_overlap=device.type == "cpu", fp8_recipe=config.fp8_recipe,
                              expert_gemm=config.expert_gemm)
    params = [p for part in parts.values() for p in part.parameters()]
    dp_rank = mesh.coords["dp"]
    group_index = dp_rank // (plan.dp // groups)  # this rank's outer group (DiLoCo); 0 otherwise
    global_tokens = group_rows(plan, group_index, groups) * plan.train.seq_len
    vocab = build_vocab_parallel(plan, mesh, config.seed, global_tokens) if plan.vocab_parallel else None
    if vocab is not None:
        params += list(vocab.slices.parameters())
    optimizer = build_optimizer(params, config.lr, config.weight_decay, parse_betas(config.betas), config.eps)
    loader = make_loader(config, plan)
    loss_fn = knobs.loss(TokenCrossEntropy(global_tokens), loader, plan.train.global_batch)
    micro_batches = plan.micro_batches_of_replica(dp_rank)
    schedule = None
    if plan.pp > 1:
        schedule = build_schedule(plan, parts, mesh.group("pp"), device, micro_batches, loss_fn, vocab)
        if plan.model.is_moe:
            forget_metadata_inference(schedule, parts)
    tracer = StepTracer.for_run(config, plan, mesh.rank, device, schedule)
    profiler = StepProfiler(config.profile_steps, config.steps, config.run_dir, mesh.rank, device)
    autocast = (torch.autocast(device.type, dtype=param_dtype) if param_dtype is not None and plan.dp == 1
                else contextlib.nullcontext())
    step_model = StepModel(plan, device, parts, loss_fn, micro_batches, schedule, tracer, autocast,
                           wrap_ddp(parts[0], data_parallel_mesh(mesh.world, plan)) if uses_ddp(plan, device)
                           else None, vocab)
    rows = replica_rows(plan, dp_rank)
    end_of_document = end_of_document_of(config, loader) if plan.train.document_mask else None
    evaluator = Evaluator.for_run(config, plan)  # None without --eval-data

    outer = OuterLoop(diloco, list(StageModels(parts).named_parameters()), mesh.group("outer") if groups > 1
                      else None, group_index) if diloco else None
    inner_bytes = inner_sync_bytes(plan, params, groups, micro_batches)
    first_step = elastic.start(parts, Checkpointer(config, plan, mesh, parts, optimizer, loader, outer,
                                                            vocab.slices if vocab else None))  # > 0: resumed
    meter = StepMeter(plan, device, mesh.rank, "fp32" if param_dtype is None else "bf16", first_step)
    metrics = MetricsFile.for_run(config, is_rank0)  # metrics file, TensorBoard, W&B, progress for an interrupt
    if metrics.wandb is not None and log is not None:
        log(metrics.wandb.describe())
    progress = Progress(config.steps, f"training {plan.model.name}: {plan.describe()} on {plan.world_size} "
                        f"{device.type} process(es)", stream) if is_rank0 and config.show_progress else None
    history: list[dict] = []
    collapse = CollapseWatch(plan.model) if plan.model.is_moe else None
    step = first_step
    stopped_at: int | None = None
    while step < config.steps:
        profiler.begin_step(step + 1)
        meter.start()
        knobs.step_started(step + 1, mesh.rank, restart)
        position = elastic.begin_step(step + 1, loader)
        tracer.begin_step(step + 1)
        lr = config.lr_of_step(step)
        set_lr(optimizer, lr)
        batch = loader.next_batch()[rows].to(device, non_blocking=True)

        # This cp rank's columns (all of them without cp), and positions / document ids when needed.
        inputs, targets, extra = shard_batch(plan, mesh.coords["cp"], batch[:, :-1], batch[:, 1:], end_of_document)
        local_loss = forward_backward(step_model, inputs, targets, extra)
        # One all-reduce: gradient-norm squares, loss, and rank 0's request for per-rank metrics.
        totals = reduce_step_totals(local_grad_norm_squared(params, plan, groups), local_loss, plan,
                                    mesh.coords["tp"], request_metrics=elastic.wants_per_rank_metrics(),
                                    outer_groups=groups, outer_index=group_index, stop=watch.requested)
        grad_norm, loss = totals.grad_norm, totals.loss
        clip_to_norm(params, config.grad_clip, totals.group_grad_norm)  # DiLoCo: each group by its own norm
        verdict = elastic.judge(loss, grad_norm)
        with tracer.span(OPTIMIZER):
            if not verdict.bad:  # the loss guard: a bad step leaves weights and optimizer state untouched
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync_metrics = outer.after_step(step + 1) if outer else {}  # DiLoCo's exchanges of this step
        sync_metrics["dp_sync_bytes"] = inner_bytes + sync_metrics.get("outer_sync_bytes", 0.0)

        moe_metrics = moe_step_metrics(parts, plan, device, not verdict.bad) if plan.model.is_moe else {}
        moe_metrics = {**moe_metrics, **sync_metrics}
        gather = gathers_metrics(step + 1, first_step + 1, config.steps, config.metrics_every, verdict.bad,
                                 totals.metrics_requested)
        if config.compile:
            moe_metrics = {**moe_metrics, "compile": True}  # the report predicts it with compiled blocks
        if plan.train.dtype == "fp8":  # ... and with the FP8 recipe that ran
            moe_metrics = {**moe_metrics, "fp8_recipe": config.fp8_recipe or "tensorwise"}
        record = meter.finish(step + 1, loss, grad_norm, lr, verdict.bad, elastic.forward_seconds(), moe_metrics,
                              gather)
        tracer.end_step()
        profiler.end_step(step + 1)
        if evaluator is not None and evaluator.due(step + 1):  # after the step's timing: not part of it
            record.update(evaluator.evaluate(step_model, rows, mesh.coords["cp"], mesh.coords["tp"],
                                             end_of_document, groups))
        history.append(record)
        if collapse is not None and is_rank0:  # reported in the run's events (RUN/events.jsonl) and on the log
            for found in collapse.observe(step + 1, record["expert_busiest"]):
                elastic.events.write("expert_collapse", step=step + 1, **found)
                if log is not None:
                    log(describe_collapse(found, plan.model))
        if is_rank0:
            metrics.write(record)
            if progress is not None:
                progress.update(record)
        step = elastic.end_step(record, verdict, position)  # after a rollback: the checkpoint's step
        history = [r for r in history if r["step"] <= step]
        if totals.stop_requested:  # SIGTERM on some rank: every rank stops here, its work saved
            elastic.stop_on_term(step)
            stopped_at = step
            break
    if outer:
        outer.flush()  # exchanges still in flight after the last step
    elastic.close()
    if progress is not None:
        progress.close()
    tracer.finish()
    profiler.finish()  # stopped inside the profiled steps: what was profiled
    metrics.close()
    if stopped_at is not None:
        raise Interrupted(signal.SIGTERM, interrupted_line(stopped_at, config.steps, config.checkpoint_dir,
                                                           newest_complete(config.checkpoint_dir))
                          if is_rank0 else "")
    if not is_rank0:
        return {}
    return {**summarize(plan, device, history, config.metrics_file),
            "checkpoint_seconds": elastic.checkpointer.seconds if elastic.checkpointer else {}}
