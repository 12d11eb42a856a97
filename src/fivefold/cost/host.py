"""Host (CPU) costs of an eager stack on profiled CPU ranks, added in series with the passes (cost/step.py):
each pass's eager ops x the profile's seconds per op, DTensor collectives' host side, FSDP2 hooks, the
unfused element-wise traffic beyond cost/layer.py's fused kernels, the zero-bubble schedules' split
backward, and the runtime's small per-step collectives."""

from __future__ import annotations

from dataclasses import replace

from fivefold.cost.comm import Topology, all_reduce_time
from fivefold.cost.layer import ZERO_PASS, PassCost
from fivefold.cost.layout import Layout, LayerCosts, RankEnv
from fivefold.cost.eager_ops import COMPILED_BLOCK_OPS, eager_ops
from fivefold.cost.stack import (SoftwareStack, TensorParallelCollectives, on_host_profiled_cpu,
                                 tensor_parallel_collectives)
from fivefold.spec.plan import SPLIT_BACKWARD, reduced_by_ddp, reductions_overlap_on_cpu

NO_TP_COLLECTIVES = TensorParallelCollectives(0, 0, 0, 0, 0, 0)


def ddp_on_cpu(layout: Layout) -> bool:
    """The runtime runs this layout under DistributedDataParallel on CPU (spec.plan.reduced_by_ddp): buckets
    of gradients, no per-module FSDP hooks or collectives."""
    return reduced_by_ddp(layout.dp, layout.cp, layout.tp, layout.pp, layout.zero, layout.ep, layout.etp)


def stack_on_profiled_cpu(layout: Layout, stack: SoftwareStack) -> SoftwareStack:
    """What a layout on CPU ranks profiled with host costs is costed with: the stack's CPU variant
    (stack.on_host_profiled_cpu), with DDP's bucketed all-reduce instead of one collective per module where
    the runtime runs DDP, and the reductions overlapped with the backward where the runtime overlaps them
    (spec.plan.reductions_overlap_on_cpu)."""
    stack = on_host_profiled_cpu(stack)
    if not stack.eager_host_costs:
        return stack
    if ddp_on_cpu(layout):
        stack = replace(stack, collective_per_module=False)
    if reductions_overlap_on_cpu(layout.dp, layout.cp, layout.tp, layout.pp, layout.zero, layout.ep,
                                 layout.num_micro_batches, layout.etp):
        stack = replace(stack, overlap_grad_reduce=True)
    return stack


def _host_pass(forward: float, backward: float, recompute: bool) -> PassCost:
    """Host seconds in series with a pass: forward, input-gradient backward, and the forward again when
    recomputed."""
    redo = forward if recompute else 0.0
    return PassCost(forward, backward, 0.0, redo, 0.0, 0.0, 0.0, 0.0, forward + backward + redo)


def with_host_costs(layout: Layout, env: RankEnv, stack: SoftwareStack, costs: LayerCosts) -> LayerCosts:
    """layer_costs' costs with the eager stack's measured host costs added when the rank's device has them,
    including the per-stage-model part (module docstring)."""
    host = env.device.host
    if host is None or not stack.eager_host_costs:
        return costs
    layer, embedding, head, activation, transient, _ = costs
    ops = eager_ops(layout.model, layout.ep)
    tensor_parallel = layout.tp > 1
    op_f = host.dtensor_op_forward if tensor_parallel else host.op_forward
    op_b = host.dtensor_op_backward if tensor_parallel else host.op_backward
    # What each tp collective (DTensor, or plain torch.distributed in MoE blocks) costs beyond the collective
    # itself (which cost/layer.py charges).
    tp = tensor_parallel_collectives(layout.sequence_parallel, layout.model) if tensor_parallel else NO_TP_COLLECTIVES
    collective = host.tp_collective
    # FSDP2 / replicate wrap each block and each stage model (DDP hooks the parameters in C++ instead).
    wrapped = layout.dp * layout.cp > 1 and not ddp_on_cpu(layout)
    hooks_f, hooks_b = (host.fsdp_unit_forward, host.fsdp_unit_backward) if wrapped else (0.0, 0.0)
    recompute = layout.recompute != "none"
    # The unfused element-wise traffic beyond cost/layer.py's fused kernels: this rank's tokens, its TP shard.
    tokens = layout.micro_batch * layout.train.seq_len / (layout.cp * layout.tp)
    per_element = env.device.element_bytes / env.device.bandwidth
    # MoE blocks included: each tp rank routes its own tokens / tp (runtime/expert_folding.py), and an etp
    # group's etp x the rows at 1/etp of the width move the same elements as its own rows at the full width;
    # the stacked expert gradients are each rank's 1/etp slice of its local experts.
    traffic_f = ops.layer_forward_traffic * tokens * per_element
    traffic_b = (ops.layer_backward_traffic * tokens + ops.layer_backward_fixed / layout.etp) * per_element
    if stack.compiled_blocks:  # inductor fuses the element-wise ops: few kernels, no unfused traffic
        ops = replace(ops, layer_forward=COMPILED_BLOCK_OPS[0], layer_backward=COMPILED_BLOCK_OPS[1])
        traffic_f = traffic_b = 0.0
    traffic = PassCost(traffic_f, traffic_b, 0.0, traffic_f if recompute else 0.0, traffic_f if recompute else 0.0,
                       0.0, 0.0, 0.0, 0.0)
    return LayerCosts(layer + traffic + _host_pass(ops.layer_forward * op_f + hooks_f + tp.layer_forward * collective,
                                         ops.layer_backward * op_b + hooks_b + tp.layer_backward * collective,
                                         recompute),
            embedding + _host_pass(ops.embedding_forward * op_f + tp.embedding_forward * collective,
                                   ops.embedding_backward * op_b + tp.embedding_backward * collective, False),
            head + _host_pass(ops.head_forward * op_f + tp.head_forward * collective,
                              ops.head_backward * op_b + tp.head_backward * collective, False),
            activation, transient,
            _host_pass(ops.stage_forward * op_f + hooks_f, hooks_b, False))


def split_backward_host(layout: Layout, env: RankEnv, stack: SoftwareStack, layers: float, stages: int) -> PassCost:
    """What the zero-bubble schedules' split backward costs the host beyond a full backward, per micro-batch,
    for `stages` stage models of `layers` layers each, none of them the first: torch.distributed.pipelining
    runs stage_backward_input (a Python walk of the stage's autograd graph to group the parameters), then
    stage_backward_weight (one autograd.grad call per parameter group, each traversing the graph beneath
    it); the first stage runs one full backward in its W pass instead. Charged to the weight pass."""
    host = env.device.host
    if host is None or not stack.eager_host_costs or layout.schedule not in SPLIT_BACKWARD or stages <= 0:
        return ZERO_PASS
    seconds = stages * (layers * host.split_backward_layer
                        + layers * (layers - 1) / 2 * host.split_backward_layer_pair)
    return ZERO_PASS._replace(backward_weight=seconds)


METRICS_EVERY = 10  # the runtime's default --metrics-every (runtime/bookkeeping.py)


def bookkeeping_time(layout: Layout, topology: Topology, env: RankEnv, pipeline_devices: list[int]) -> float:
    """The runtime's small collectives of a step (runtime/bookkeeping.py), each rank waiting for them: one
    all-reduce over the world of [gradient-norm squares, loss, metrics request] (float64), and the per-rank
    metrics table's every METRICS_EVERY steps (amortised)."""
    world = topology.group_link([layout.placement[r] if layout.placement else r for r in range(layout.world_size)])
    return all_reduce_time(24, world) + all_reduce_time(24 * layout.world_size, world) / METRICS_EVERY
