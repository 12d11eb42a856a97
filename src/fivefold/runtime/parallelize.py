"""Tensor parallelism (+ sequence parallel), activation checkpointing and data parallelism / ZeRO,
applied to one model (or one pipeline stage of it) in TorchTitan's order: TP -> AC -> DP.

Data parallelism and the ZeRO levels map onto FSDP2 (torch.distributed.fsdp.fully_shard) and its
sibling `replicate`, because both compose with DTensor tensor parallelism (2-D meshes) and with
torch.distributed.pipelining (a PipelineStage drives their gradient sync itself):

    zero 0  replicate(): every rank keeps all weights; gradients all-reduced once per step.
    zero 1  fully_shard(reshard_after_forward=False), gradient sync and resharding switched off until
            the last micro-batch: full gradients accumulate locally and are reduce-scattered once per
            step, parameters are all-gathered once per step, and the optimizer state is sharded.
    zero 2  fully_shard(reshard_after_forward=False): gradients reduce-scattered every micro-batch
            (sharded gradients), parameters stay gathered between forward and backward.
    zero 3  fully_shard(reshard_after_forward=True): parameters resharded after forward and gathered
            again for backward (FSDP).

Under pipeline parallelism the PipelineStage defers every gradient sync to the end of the step, so
zero 1 and 2 behave alike there (both accumulate full gradients).

Gradients are reduced with a plain SUM (divide factor 1): the loss is already divided by the number of
target tokens in the global batch, so summed gradients equal the single-process ones.

Overlap on CPU (gloo). FSDP2 overlaps its collectives through CUDA streams; on CPU those are no-ops and each
wrapped module's reduction blocks the backward. So on gloo:
- zero 0 without tp/pp runs under DistributedDataParallel (what a user's torchrun script would use): its
  bucketed all-reduce runs in gloo's worker threads while autograd computes the earlier layers;
- zero 1-3 give FSDP2 a reduce-scatter that returns before the data has arrived (AsyncReduceScatter); the
  loop waits for all of them before the gradients are read (finish_gradient_sync, before the clipping). A
  reduction that FSDP2 adds into an existing gradient (zero 2/3, micro-batches after the first) reads its
  output at once, so those stay synchronous;
- zero 0 with tp or pp keeps `replicate` (synchronous per block; under pp the PipelineStage reduces each
  stage once, at the end of its last backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fivefold.models import MoE, Transformer
from fivefold.spec.plan import reduced_by_ddp


# --- tensor parallel -------------------------------------------------------------------------------

def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          positions_per_row: bool = False) -> None:
    """Megatron-style TP through DTensor: q/k/v and w1/w3 split by columns, wo and w2 by rows, the
    embedding split by vocabulary rows. With sequence parallel the norms and the residual stream are
    split along the sequence (all-gather before attention/MLP, reduce-scatter after).
    `positions_per_row`: the runtime passes positions [batch, seq] (context parallel, packed documents)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.pos_embeddings is not None:
        # The position table's output is [seq, hidden] and broadcasts over the batch: its sequence dim
        # is dim 0, so under SP it is reduce-scattered to Shard(0) to line up with the tokens' Shard(1).
        # Positions given per row make it [batch, seq, hidden], sequence on dim 1 like the tokens.
        seq_dim = 1 if positions_per_row else 0
        top["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                output_layouts=Shard(seq_dim) if sequence_parallel else Replicate())
    if model.norm is not None and sequence_parallel:
        # Without the head on this stage (vocabulary parallel) the normed states leave the stage as this
        # rank's plain sequence slice, which the vocabulary passes work on.
        top["norm"] = SequenceParallel(use_local_output=model.output is None)
    if model.output is not None:
        # Logits come back whole on every tp rank, so the loss is the plain cross-entropy.
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)

    for block in model.layers.values():
        block_plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        moe = isinstance(block.feed_forward, MoE)
        if moe:  # the MoE block splits its tokens over tp instead (runtime/expert_folding.py)
            del block_plan["feed_forward.w1"], block_plan["feed_forward.w2"]
        elif block.feed_forward.w3 is not None:
            block_plan["feed_forward.w3"] = ColwiseParallel()
        if block.attention.q_norm is not None:
            # Per-head q/k norms (Qwen3) see this rank's heads: replicated weights over input split on the
            # head dim, so their gradients are summed over tp (Partial, as a sequence-parallel norm's).
            block_plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            block_plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if sequence_parallel:
            block_plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                # attention(x, positions, documents): gather x along the sequence, leave the others alone.
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
            if moe:
                from fivefold.runtime.expert_parallel import moe_tensor_parallel_style
                block_plan["feed_forward"] = moe_tensor_parallel_style(True)
        parallelize_module(block, tp_mesh, block_plan)


# --- activation checkpointing ----------------------------------------------------------------------

# Ops whose outputs selective recompute keeps: the matmuls and attention (expensive to redo) and
# collectives (must not run twice). Norms, activations and other pointwise ops are recomputed:
# cheap to redo but they hold most of the activation memory (Korthikanti et al. 2022, section 5).
_SAVE_OPS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops.aten._scaled_mm.default,  # FP8 GEMMs (runtime/float8.py)
    *([torch.ops.aten._grouped_mm.default] if hasattr(torch.ops.aten, "_grouped_mm") else []),  # MoE experts
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """`full`: keep only each block's input and recompute the block in backward; `selective`: also keep
    matmul/attention outputs.

    Blocks are wrapped with checkpoint_wrapper (as TorchTitan does), which adds a
    `_checkpoint_wrapped_module.` component to parameter names; seeded init and torch's
    get_model_state_dict leave it out. The composable `checkpoint` keeps names but breaks the
    zero-bubble schedules' separate weight-gradient pass.
    """
    if mode == "none":
        return
    for key, block in list(model.layers.items()):
        if mode == "full":
            model.layers[key] = checkpoint_wrapper(block)
        else:
            model.layers[key] = checkpoint_wrapper(block, context_fn=_selective_contexts)


# --- torch.compile ---------------------------------------------------------------------------------

def apply_compile(model: Transformer) -> None:
    """Compile each transformer block in place (nn.Module.compile keeps the module, so parameter names,
    hooks and checkpoints are unchanged), after TP and activation checkpointing and before FSDP, as
    TorchTitan does. The blocks share one graph: dynamo treats their parameters as inputs, so the first
    block's compilation serves all (same shapes).

    torch.fx's interpreter draws a tqdm bar while compiling, and tqdm's default lock is a multiprocessing
    semaphore: a worker stopped by Ctrl-C leaves it behind and Python's resource tracker prints a warning after
    fivefold's one interrupt line. A worker draws no bar of its own, so a thread lock serves tqdm as well."""
    _thread_lock_for_tqdm()
    for block in model.layers.values():
        block.compile(fullgraph=False)


def _thread_lock_for_tqdm() -> None:
    try:
        from tqdm import tqdm
    except ImportError:  # no tqdm, no bar and no semaphore
        return
    import threading

    tqdm.set_lock(threading.RLock())


# --- data parallel / ZeRO --------------------------------------------------------------------------

class AsyncReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter, issued asynchronously (module docstring). Keeps each pending collective's
    buffers alive until `wait`; `async_op` is switched off for reductions FSDP2 accumulates at once."""

    def __init__(self) -> None:
        self.pending: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []
        self.async_op = True

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> dist.Work:
        if not self.async_op:
            self.wait()  # FIFO per process group anyway; keeps `pending` short
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        work = super().__call__(output_tensor, input_tensor, group, op, async_op=True)
        self.pending.append((work, output_tensor, input_tensor))
        return work  # FSDP2 does not wait on what its comm returns

    def wait(self) -> None:
        for work, _, _ in self.pending:
            work.wait()
        self.pending.clear()


def uses_ddp(plan, device: torch.device) -> bool:
    """On CPU, the layouts spec.plan.reduced_by_ddp names run under DistributedDataParallel (module
    docstring); experts sharded over ep are then each rank's own, and DDP leaves them out (wrap_ddp)."""
    return device.type == "cpu" and reduced_by_ddp(plan.dp, plan.cp, plan.tp, plan.pp, plan.zero, plan.ep,
                                                    plan.etp)


def _sum_gradients(group, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP comm hook: a plain SUM all-reduce of the bucket (DDP's default divides by the world size)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def wrap_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """The module the loop calls: `model` under DDP over `dp_mesh` (dp, or dp x cp flattened) after its
    weights are initialised (DDP broadcasts them from rank 0 when it is built). `model` itself keeps the
    parameters, names and hooks. DTensor parameters (experts sharded over ep, uses_ddp) are left out: each
    is this rank's own shard, summed over every rank's tokens by the all-to-all already."""
    from torch.distributed.tensor import DTensor

    own = [name for name, param in model.named_parameters() if isinstance(param, DTensor)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, own)
    group = dp_mesh.get_group()
    ddp = DistributedDataParallel(model, process_group=group, forward_sync_buffers=False)  # buffers are seeded alike
    ddp.register_comm_hook(group, _sum_gradients)
    return ddp


def apply_data_parallel(model: Transformer, dp_mesh: DeviceMesh, zero: int,
                        param_dtype: torch.dtype | None, overlap_on_cpu: bool = False) -> None:
    """Wrap each block, then the whole (stage) model, so each block's weights are one collective.
    `param_dtype` (bf16 on GPU) computes in that dtype and reduces gradients in fp32. `overlap_on_cpu`
    (gloo): zero 1-3 reduce-scatter asynchronously (module docstring); zero 0 is then DDP's (wrap_ddp)."""
    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
        MixedPrecisionPolicy()
    if zero == 0:
        for block in model.layers.values():
            replicate(block, mesh=dp_mesh, mp_policy=mixed)
        replicate(model, mesh=dp_mesh, mp_policy=mixed)
    else:
        reshard = zero == 3
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mixed)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mixed)
    comm = AsyncReduceScatter() if overlap_on_cpu and zero > 0 else None
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives (gloo has no PREMUL_SUM; NCCL needs SUM for zero-copy transfers).
            module.set_force_sum_reduction_for_comms(True)
            if comm is not None:
                module.set_custom_reduce_scatter(comm)
    if comm is not None:
        model.async_reduce_scatter = comm  # type: ignore[assignment]  # found by finish_gradient_sync


def set_gradient_sync(model: nn.Module, zero: int, micro_batch: int, micro_batches: int) -> None:
    """Gradient accumulation without pipeline parallelism: which micro-batches reduce gradients."""
    last_micro_batch = micro_batch == micro_batches - 1
    if isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = last_micro_batch  # what DDP.no_sync() switches
        return
    if not isinstance(model, FSDPModule):
        return
    comm = getattr(model, "async_reduce_scatter", None)
    if comm is not None:
        # zero 2/3 add each micro-batch's reduced gradient into the previous one as soon as it is issued.
        comm.async_op = zero == 1 or micro_batch == 0
    if zero in (0, 1):
        # Accumulate full gradients locally; one reduction at the last micro-batch.
        model.set_requires_gradient_sync(last_micro_batch)
    if zero == 1:
        # Keep the gathered parameters for the next micro-batch instead of gathering again.
        model.set_reshard_after_backward(last_micro_batch)


def finish_gradient_sync(parts: dict[int, nn.Module] | list[nn.Module]) -> None:
    """Wait for the asynchronous gradient reductions of this step (before anything reads a gradient)."""
    for part in (parts.values() if isinstance(parts, dict) else parts):
        comm = getattr(part, "async_reduce_scatter", None)
        if comm is not None:
            comm.wait()
            comm.async_op = True
