"""The training loop of one worker process: any plan, read top to bottom.

build the mesh -> build this rank's stage model(s): TP -> activation checkpointing -> DP/ZeRO ->
to_empty + seeded init -> for each step: the global batch, this replica's rows, forward/backward
(pipelined or with gradient accumulation), clip by the global norm, AdamW, metrics.

The loss is the sum of token cross-entropies divided by the number of target tokens in the GLOBAL
batch, so summing over micro-batches, replicas and stages gives exactly the single-process loss and
gradients: every plan computes the same training run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.cost.flops import model_flops_per_step
from fivefold.elastic.events import EventLog, restart_count, write_pid
from fivefold.elastic.guard import LossGuard, Verdict, injected_loss_factors
from fivefold.elastic.hang import init_distributed_with_timeout, step_started
from fivefold.elastic.restart import newest_complete, resume_point
from fivefold.elastic.stragglers import ForwardClock, StragglerWatch, describe_straggler
from fivefold.models import init_weights
from fivefold.runtime.checkpointing import Checkpointer, log_to
from fivefold.runtime.config import RunConfig
from fivefold.runtime.expert_parallel import (expert_mesh, forget_metadata_inference, moe_step_metrics,
                                              prepare_moe)
from fivefold.runtime.mesh import Mesh, build_mesh, init_distributed, pick_device
from fivefold.runtime.metrics import (MetricsFile, Progress, gather_from_ranks, peak_flops, peak_memory_gib,
                                      seconds_since)
from fivefold.runtime.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from fivefold.runtime.parallelize import (apply_activation_checkpointing, apply_data_parallel,
                                          apply_tensor_parallel, set_gradient_sync)
from fivefold.runtime.pipeline import build_schedule, build_stage_model, run_schedule
from fivefold.runtime.slowdown import slow_down
from fivefold.runtime.trace import BACKWARD, FORWARD, OPTIMIZER, StepTracer
from fivefold.spec import Plan


class TokenCrossEntropy:
    """sum over tokens of cross-entropy / target tokens in the global batch."""

    def __init__(self, global_tokens: int) -> None:
        self.global_tokens = global_tokens
        self.injected: float | None = None  # test-only fault injection (elastic/guard.py) for this batch

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        if self.injected is not None:
            loss = loss * self.injected
        return loss / self.global_tokens


def compute_dtype(plan: Plan, device: torch.device) -> torch.dtype | None:
    """bf16 mixed precision on a GPU when the plan trains in bf16; fp32 otherwise (always on CPU)."""
    if device.type != "cuda" or plan.train.dtype == "fp32":
        return None
    if plan.train.dtype == "fp16":
        raise RuntimeError("fp16 training needs loss scaling, which the runtime does not do; use bf16")
    return torch.bfloat16


def build_model_parts(plan: Plan, mesh: Mesh, seed: int, param_dtype: torch.dtype | None) -> dict[int, nn.Module]:
    """This rank's stage models, keyed by virtual stage index, parallelized and initialised."""
    parts = {}
    moe_mesh = expert_mesh(plan, mesh.device) if plan.ep > 1 else None
    for stage in plan.stages_of(mesh.coords["pp"]):
        model = slow_down(build_stage_model(plan, stage), plan, mesh.rank)  # test-only knob (slowdown.py)
        if plan.tp > 1:
            apply_tensor_parallel(model, mesh["tp"], plan.sequence_parallel)
        apply_activation_checkpointing(model, plan.recompute)
        if plan.model.is_moe:
            prepare_moe(model, plan, moe_mesh, param_dtype)  # experts over ep, before dp wraps the blocks
        if plan.dp > 1:
            apply_data_parallel(model, mesh["dp"], plan.zero, param_dtype)
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


def make_loader(config: RunConfig, plan: Plan):
    from fivefold.data import GlobalBatchLoader, load_tokenizer, open_dataset

    dataset = open_dataset(config.data, load_tokenizer(config.tokenizer))
    return GlobalBatchLoader(dataset, seq_len=plan.train.seq_len, global_batch=plan.train.global_batch,
                             seed=config.seed)


def reduce_loss(local_loss: torch.Tensor, plan: Plan, mesh: Mesh) -> float:
    """The step's global loss: summed over the pipeline (only the last stage holds a loss) and over
    the data-parallel replicas (each holds its rows' share)."""
    for dim in ("pp", "dp"):
        if getattr(plan, dim) > 1:
            dist.all_reduce(local_loss, group=mesh.group(dim))
    return local_loss.item()


def agree_bad(verdict: Verdict, device: torch.device) -> Verdict:
    """A step is bad when any rank judged it bad: one tiny all-reduce keeps every rank in lockstep."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return verdict
    flag = torch.tensor([float(verdict.bad)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return verdict if verdict.bad or not flag.item() else Verdict(True, "another rank judged the step bad")


def skip_bad_batches(loader, bad_positions: set[int]) -> int:
    """Draw past the batches the loss guard marked bad; the position (samples_seen) of the next batch."""
    while loader.samples_seen in bad_positions:
        loader.next_batch()
    return loader.samples_seen


def hostnames() -> list[str]:
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return names


def train(config: RunConfig) -> dict:
    """Run `config.steps` steps of the plan on this process's rank; rank 0 returns the summary."""
    started = time.time()
    restart = restart_count()  # > 0: the elastic agent restarted us after a failure; continue from the newest checkpoint
    config = dataclasses.replace(config, resume_from=resume_point(config.checkpoint_dir, config.resume_from, restart))
    plan = config.plan
    # nn.Linear on [batch, seq, hidden] returns a reshaped view, which FSDP2 flags in case someone
    # modifies it in place; the logits are only read by the loss.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    device = pick_device(config.device, plan)
    init_distributed_with_timeout(device, config.collective_timeout)
    init_distributed(device)
    mesh = build_mesh(plan, device)
    is_rank0 = mesh.rank == 0
    param_dtype = compute_dtype(plan, device)
    autocast = (torch.autocast(device.type, dtype=param_dtype) if param_dtype is not None and plan.dp == 1
                else contextlib.nullcontext())

    write_pid(config.run_dir, mesh.rank)
    events = EventLog(config.run_dir if is_rank0 else None, restart)
    events.write("start", started=started, resume_from=config.resume_from, world_size=plan.world_size)
    parts = build_model_parts(plan, mesh, config.seed, param_dtype)
    forward_clock = ForwardClock(device)
    for part in parts.values():
        forward_clock.attach(part)
    params = [p for part in parts.values() for p in part.parameters()]
    optimizer = build_optimizer(params, config.lr)
    loss_fn = TokenCrossEntropy(plan.train.global_batch * plan.train.seq_len)
    dp_rank = mesh.coords["dp"]
    micro_batches = plan.micro_batches_of_replica(dp_rank)
    schedule = None
    if plan.pp > 1:
        schedule = build_schedule(plan, parts, mesh.group("pp"), device, micro_batches, loss_fn)
        if plan.model.is_moe:
            forget_metadata_inference(schedule, parts)
    model = parts[0] if plan.pp == 1 else None
    tracer = StepTracer.for_run(config, plan, mesh.rank, device, schedule)
    loader = make_loader(config, plan)
    rows = replica_rows(plan, dp_rank)

    flops_per_step = model_flops_per_step(plan.model, plan.train)
    # MFU = model FLOPs per step / (step time x summed peak FLOP/s of the dtype actually computed in).
    total_peak_flops = peak_flops(plan, "fp32" if param_dtype is None else "bf16")
    metrics = MetricsFile(config.metrics_file if is_rank0 else None)
    stream = sys.stderr if config.progress_to_stderr else sys.stdout
    checkpointer = Checkpointer(config, plan, mesh, parts, optimizer, loader)
    log = log_to(stream) if is_rank0 else None
    first_step = checkpointer.start(log)  # > 0 when resuming
    events.write("resumed" if config.resume_from else "ready", step=first_step, path=config.resume_from)
    guard = LossGuard(config.max_loss_spike, config.max_bad_steps)
    injected = injected_loss_factors()
    stragglers = StragglerWatch(config.straggler_factor, config.straggler_patience,
                                hosts=hostnames() if config.straggler_factor > 0 and plan.world_size > 1 else [])
    progress = Progress(config.steps, f"training {plan.model.name}: {plan.describe()} on {plan.world_size} "
                        f"{device.type} process(es)", stream) if is_rank0 and config.show_progress else None
    history: list[dict] = []
    tokens = first_step * plan.train.tokens_per_step
    step = first_step
    while step < config.steps:
        start = time.perf_counter()
        step_started(step + 1, mesh.rank, restart)  # notes the step for a timeout's error line; the hang knob
        tracer.begin_step(step + 1)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        lr = lr_at(step, config.lr, config.warmup_steps, config.steps)
        set_lr(optimizer, lr)
        position = skip_bad_batches(loader, guard.bad_positions)
        loss_fn.injected = injected.get(position // plan.train.global_batch + 1)
        batch = loader.next_batch()[rows].to(device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]

        with autocast:
            if schedule is not None:
                local_loss = run_schedule(schedule, plan, list(parts), inputs, targets)
                if local_loss is None:
                    local_loss = torch.zeros((), device=device)
            else:
                local_loss = torch.zeros((), device=device)
                for index, (mb_inputs, mb_targets) in enumerate(zip(inputs.split(plan.micro_batch),
                                                                    targets.split(plan.micro_batch))):
                    set_gradient_sync(model, plan.zero, last_micro_batch=index == micro_batches - 1)
                    with tracer.span(FORWARD, 0, index):
                        loss = loss_fn(model(mb_inputs), mb_targets)
                    with tracer.span(BACKWARD, 0, index):
                        loss.backward()
                    local_loss += loss.detach()

        grad_norm = clip_grad_norm_(params, config.grad_clip, plan)
        loss_value = reduce_loss(local_loss, plan, mesh)
        verdict = agree_bad(guard.judge(loss_value, grad_norm), device)
        with tracer.span(OPTIMIZER):
            if not verdict.bad:  # the loss guard: a bad step leaves weights and optimizer state untouched
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        moe_metrics = moe_step_metrics(parts, plan, device, not verdict.bad) if plan.model.is_moe else {}
        own_step_time = seconds_since(start, device)  # this rank's step, before the gathers below
        memory_per_rank, time_per_rank, forward_per_rank = zip(*gather_from_ranks(
            [peak_memory_gib(device), own_step_time, forward_clock.take()], device, mesh.rank))
        memory = max(memory_per_rank)  # the busiest rank's memory is the one that must fit
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time = time.perf_counter() - start
        tracer.end_step()

        tokens += plan.train.tokens_per_step
        record = {"step": step + 1, "loss": loss_value, "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
                  "step_time_s": step_time, "tokens_per_s": plan.train.tokens_per_step / step_time,
                  "mfu": flops_per_step / (step_time * total_peak_flops), "peak_memory_gib": memory,
                  "peak_memory_gib_per_rank": list(memory_per_rank), "step_time_s_per_rank": list(time_per_rank),
                  "first_step": first_step + 1, "forward_time_s_per_rank": list(forward_per_rank),
                  "skipped": verdict.bad, "wall_time": time.time(), **moe_metrics}
        history.append(record)
        guard.record(verdict, loss_value, position)
        if is_rank0:
            metrics.write(record)
            if progress is not None:
                progress.update(record)
            if verdict.bad:
                log(f"loss guard: step {step + 1} (batch at sample {position}): {verdict.reason}; update skipped "
                    f"({guard.bad_in_a_row} bad in a row, rollback at {config.max_bad_steps or 'never'})")
                events.write("bad_step", step=step + 1, position=position, reason=verdict.reason)
            for found in stragglers.observe(step + 1, list(forward_per_rank)):
                log(describe_straggler(found))
                events.write("straggler", step=step + 1, **found)
        checkpointer.step_done(step + 1)
        step += 1
        if guard.should_roll_back:
            step = roll_back(checkpointer, guard, step, events, log)
            history = [r for r in history if r["step"] <= step]
    checkpointer.close()
    if progress is not None:
        progress.close()
    tracer.finish()
    metrics.close()
    if not is_rank0:
        return {}
    return {**summarize(plan, device, history, config), "checkpoint_seconds": checkpointer.seconds}


def roll_back(checkpointer: Checkpointer, guard: LossGuard, step: int, events: EventLog, log) -> int:
    """After too many bad steps in a row: reload the newest checkpoint (every rank the one rank 0 found,
    once the save in flight is committed); the step to continue from. The bad batches stay skipped."""
    checkpointer.wait()
    found = [newest_complete(checkpointer.config.checkpoint_dir) if checkpointer.rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    positions = sorted(guard.pending)
    guard.rolled_back()
    if found[0] is None:
        if log:
            log(f"loss guard: {len(positions)} bad steps in a row up to step {step}, but no checkpoint to roll back "
                "to (give --checkpoint-dir and --checkpoint-every); the bad batches stay skipped")
        events.write("rollback", step=step, to_step=None, positions=positions, reload_s=0.0)
        return step
    started = time.perf_counter()
    to_step = checkpointer.load(Path(found[0]))
    reload_s = time.perf_counter() - started
    if log:
        log(f"loss guard: {len(positions)} bad steps in a row up to step {step}: rolled back to step {to_step} "
            f"({found[0]}, {reload_s:.2f} s); batches at samples {positions} will be skipped")
    events.write("rollback", step=step, to_step=to_step, positions=positions, reload_s=reload_s, path=found[0])
    return to_step


def summarize(plan: Plan, device: torch.device, history: list[dict], config: RunConfig) -> dict:
    """Rank 0's account of the run; step times leave out the first step (warm-up, lazy init)."""
    timed = history[1:] or history
    mean_time = sum(r["step_time_s"] for r in timed) / max(1, len(timed))
    return {
        "plan": plan.describe(), "world_size": plan.world_size, "device": device.type, "steps": len(history),
        "losses": [r["loss"] for r in history], "grad_norms": [r["grad_norm"] for r in history],
        "final_loss": history[-1]["loss"] if history else None,
        "mean_step_time_s": mean_time,
        "tokens_per_s": plan.train.tokens_per_step / mean_time if mean_time else 0.0,
        "mfu": sum(r["mfu"] for r in timed) / max(1, len(timed)),
        "peak_memory_gib": max((r["peak_memory_gib"] for r in history), default=0.0),
        "metrics_file": config.metrics_file,
    }
