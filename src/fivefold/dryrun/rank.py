"""One rank of a plan, built and stepped by the runtime's own code on fake tensors, its memory accounted.

The build is runtime/train.py's: the mesh (runtime/mesh.py), the rank's stage models (pipeline split,
TP/SP, activation checkpointing, FSDP2/replicate with the mixed-precision policy, seeded init), AdamW
(runtime/optim.py), the loss, and one step: the pipeline schedule over this replica's micro-batches (or
gradient accumulation without pp), the global-norm clip, the optimizer step. Before the measured step
the optimizer takes one step on zero gradients, so its state exists as in every step after the first.

PyTorch's accounting (torch.distributed._tools): FSDPMemTracker when the rank's models are FSDP2/replicate
modules, MemTracker otherwise. Both see every tensor allocated on the rank and keep the peak snapshot by
kind; `Accounted` folds their kinds into the cost model's parts.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fivefold.dryrun.world import (fake_world, meshes_outside_fake, static_pipeline, swappable_fake_parameters,
                                   value_free)
from fivefold.spec import Plan

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker

GIB = 2**30

# Tracker kinds -> the cost model's parts (cost/memory.py RankMemory). FSDP2's gathered (unsharded) weights
# and its all-gather / reduce-scatter buffers are working memory: the cost model counts them as transient.
PARTS = {
    "Parameter": "params", "Sharded Param": "params", "Buffer": "params",
    "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "grads",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Inputs": "activations",
    "Unsharded Param": "transient", "Temp": "transient", "All Gather": "transient", "Reduce Scatter": "transient",
}


@dataclass
class Accounted:
    """The peak of one rank's step as PyTorch accounted it: bytes by cost-model part and by tracker kind."""

    peak: float
    parts: dict[str, float]
    kinds: dict[str, float]
    seconds: float  # wall time of build + step
    micro_batches: int  # micro-batches this rank ran
    cpu_seconds: float = 0.0  # CPU time of build + step (what a busy shared machine does not stretch)


def stage_metas(plan: Plan, activation_dtype: torch.dtype, device: torch.device) -> dict:
    """(inputs, outputs) example tensors of every virtual stage for one micro-batch: token ids into the
    first, logits out of the last, the (sequence-parallel shard of the) hidden state in between."""
    mb, seq, hidden = plan.micro_batch, plan.train.seq_len, plan.model.hidden
    local_seq = seq // plan.cp // (plan.tp if plan.sequence_parallel else 1)
    # requires_grad: a gradient flows back across every stage boundary.
    hidden_state = torch.empty(mb, local_seq, hidden, dtype=activation_dtype, device=device, requires_grad=True)
    tokens = torch.empty(mb, seq // plan.cp, dtype=torch.long, device=device)
    logits = torch.empty(mb, seq // plan.cp, plan.model.vocab, dtype=activation_dtype, device=device)
    last = plan.num_stages - 1
    return {s: ((tokens,) if s == 0 else (hidden_state,), (logits,) if s == last else (hidden_state,))
            for s in range(plan.num_stages)}


def _tracker(parts: dict[int, nn.Module], optimizer: torch.optim.Optimizer,
             inputs: tuple[torch.Tensor, ...]) -> "MemTracker":
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    models = list(parts.values())
    if all(isinstance(m, FSDPModule) for m in models):
        fsdp_tracker = FSDPMemTracker(models[0], optimizer)
        if len(models) > 1:  # several virtual stages: instrument every root (the tracker walks _root_mod)
            setattr(fsdp_tracker, "_root_mod", nn.ModuleList(models))
        fsdp_tracker.track_inputs(inputs)
        return _global_peak_only(fsdp_tracker)
    tracker = MemTracker()
    tracker.track_external(*models, optimizer, *inputs)
    return _global_peak_only(tracker)


def _global_peak_only(tracker: "MemTracker") -> "MemTracker":
    """After every op the trackers update the peak of every module seen so far (O(modules) per op: half the
    dry run's time at 70B scale); the dry run reads only the rank's peak, so only that is kept."""

    def update_peak(peak_state: object) -> None:
        for device, snapshot in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(device, 0) < snapshot["Total"]:
                tracker._peak_mem[device] = snapshot["Total"]
                tracker._peak_mem_snap[device] = dict(snapshot)

    setattr(tracker, "_update_peak_stats", update_peak)
    return tracker


@contextlib.contextmanager
def _per_micro_batch_stats(tracker, roots: list[nn.Module]):
    """The trackers keep per-module statistics for one forward of each root module and refuse a second;
    a step runs one forward per micro-batch, so a root's statistics are dropped before each forward (the
    peak, which is what is measured, is kept). A global hook registered before the tracker's runs first."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    ids = {id(root) for root in roots}

    def drop(module: nn.Module, args: tuple) -> None:
        if id(module) in ids and not tracker._mod_tracker.is_bw:
            tracker.memory_tracking.pop(module, None)

    handle = register_module_forward_pre_hook(drop)
    try:
        yield
    finally:
        handle.remove()


def _peak(tracker, started: float, micro_batches: int) -> Accounted:
    snapshot = tracker.get_tracker_snapshot("peak")
    by_device = max(snapshot.values(), key=lambda kinds: kinds["Total"])
    kinds = {str(getattr(kind, "value", kind)): float(value) for kind, value in by_device.items() if kind != "Total"}
    parts = {name: 0.0 for name in ("params", "grads", "optimizer", "activations", "transient")}
    for kind, value in kinds.items():
        parts[PARTS.get(kind, "transient")] += value
    return Accounted(float(by_device["Total"]), parts, kinds, time.perf_counter() - started, micro_batches,
                     time.process_time())


def measure_rank(plan: Plan, rank: int, gpu_configuration: bool, seed: int = 0) -> Accounted:
    """Build `rank` of `plan` on fake tensors in a fake world and account one training step.

    `gpu_configuration`: the runtime takes its CUDA branches (bf16 weights in FSDP2's mixed-precision
    policy, fp32 gradient reduction; autocast without dp), on fake CPU tensors (see docs/dryrun.md)."""
    from fivefold.runtime.mesh import build_mesh
    from fivefold.runtime.train import compute_dtype

    started = time.perf_counter()
    device = torch.device("cpu")
    param_dtype = compute_dtype(plan, torch.device("cuda" if gpu_configuration else "cpu"))
    with fake_world(plan.world_size, rank):
        mesh = build_mesh(plan, device)  # outside FakeTensorMode: DeviceMesh reads its rank table
        with FakeTensorMode() as mode, swappable_fake_parameters(mode), meshes_outside_fake():
            return build_and_step(plan, mesh, param_dtype, seed, started, fake=True)


def balanced_moe(parts: dict[int, nn.Module]) -> None:
    """Every MoE block routes the balanced share of copies to each expert (models/moe.py balanced_counts):
    fake tensors have no values to route by, and the real run of dryrun/real.py must do the same step."""
    from fivefold.models import MoE

    for part in parts.values():
        for module in part.modules():
            if isinstance(module, MoE):
                module.balanced = True


def build_and_step(plan: Plan, mesh, param_dtype: torch.dtype | None, seed: int, started: float,
                   fake: bool) -> Accounted:
    """Build this rank's models on `mesh` and account one step; `fake=False` is the same on real tensors in
    a real process group (dryrun/real.py), where the clip reads its norm."""
    from fivefold.runtime.context_parallel import shard_batch, split_micro_batches
    from fivefold.runtime.optim import build_optimizer, clip_grad_norm_
    from fivefold.runtime.parallelize import set_gradient_sync
    from fivefold.runtime.pipeline import build_schedule, run_schedule
    from fivefold.runtime.train import TokenCrossEntropy, build_model_parts

    device = mesh.device
    parts = build_model_parts(plan, mesh, seed, param_dtype)
    balanced_moe(parts)
    params = [p for part in parts.values() for p in part.parameters()]
    optimizer = build_optimizer(params, lr=1e-4)
    for param in params:  # optimizer state as in every step after the first
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    micro_batches = plan.micro_batches_of_replica(mesh.coords["dp"])
    rows = micro_batches * plan.micro_batch
    tokens = torch.randint(1, plan.model.vocab, (rows, plan.train.seq_len + 1), device=device)
    # This cp rank's columns and the model's positions / document ids, exactly as training cuts them.
    inputs, targets, extra = shard_batch(plan, mesh.coords["cp"], tokens[:, :-1], tokens[:, 1:], 0)
    mb_extras = split_micro_batches(extra, plan.micro_batch) or [{}] * micro_batches
    loss_fn = TokenCrossEntropy(plan.train.global_batch * plan.train.seq_len)
    autocast = (torch.autocast(device.type, dtype=param_dtype) if param_dtype is not None and plan.dp == 1
                else contextlib.nullcontext())
    schedule = None
    if plan.pp > 1:
        schedule = build_schedule(plan, parts, mesh.group("pp"), device, micro_batches, loss_fn)
        activation_dtype = param_dtype if param_dtype is not None and plan.dp > 1 else torch.float32
        # Static shapes on real tensors too: the tracker's hooks refuse the autograd.grad call of the
        # dynamic shape inference, which only runs in a run's first step anyway.
        static_pipeline(schedule, stage_metas(plan, activation_dtype, device))

    tracker = _tracker(parts, optimizer, (inputs, targets))
    with _per_micro_batch_stats(tracker, list(parts.values())), tracker:
        with autocast:
            if schedule is not None:
                run_schedule(schedule, plan, list(parts), inputs, targets, extra)
            else:
                model = parts[0]
                for index, (mb_in, mb_out) in enumerate(zip(inputs.split(plan.micro_batch),
                                                            targets.split(plan.micro_batch))):
                    set_gradient_sync(model, plan.zero, index, micro_batches)
                    loss_fn(model(mb_in, **mb_extras[index]), mb_out).backward()
        if fake:
            value_free(lambda: clip_grad_norm_(params, 1.0, plan))
        else:
            clip_grad_norm_(params, 1.0, plan)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _peak(tracker, started, micro_batches)
