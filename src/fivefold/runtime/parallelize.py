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
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fivefold.models import MoE, Transformer


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
        top["norm"] = SequenceParallel()
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
        if moe:  # experts are not split by tp (runtime/expert_parallel.py says why)
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


# --- data parallel / ZeRO --------------------------------------------------------------------------

def apply_data_parallel(model: Transformer, dp_mesh: DeviceMesh, zero: int,
                        param_dtype: torch.dtype | None) -> None:
    """Wrap each block, then the whole (stage) model, so each block's weights are one collective.
    `param_dtype` (bf16 on GPU) computes in that dtype and reduces gradients in fp32."""
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
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives (gloo has no PREMUL_SUM; NCCL needs SUM for zero-copy transfers).
            module.set_force_sum_reduction_for_comms(True)


def set_gradient_sync(model: nn.Module, zero: int, last_micro_batch: bool) -> None:
    """Gradient accumulation without pipeline parallelism: which micro-batches reduce gradients."""
    if not isinstance(model, FSDPModule):
        return
    if zero in (0, 1):
        # Accumulate full gradients locally; one reduction at the last micro-batch.
        model.set_requires_gradient_sync(last_micro_batch)
    if zero == 1:
        # Keep the gathered parameters for the next micro-batch instead of gathering again.
        model.set_reshard_after_backward(last_micro_batch)

