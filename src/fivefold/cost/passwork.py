"""One pass's work on one rank: GPU seconds, kernel launches and exposed communication, and what they come
to once the CPU that issues the kernels is counted (PassCost). cost/layer.py and cost/moe_block.py add to it.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

from fivefold.cost.compute import Device, elementwise_time, gemm_time
from fivefold.cost.fp8 import gathers_fp8_weights, recipe_time_factor
from fivefold.cost.stack import SoftwareStack


class PassCost(NamedTuple):
    """Seconds of one layer (or embedding/head) for one micro-batch, split the way the schedules need.

    A NamedTuple rather than a frozen dataclass because the planner adds and scales ~10^5 of them per
    search and a tuple is built several times faster; `+` adds field by field (it never concatenates)."""

    forward: float  # forward, comm included
    backward_input: float  # input-gradient backward, comm included (no recompute)
    backward_weight: float  # weight-gradient backward
    recompute: float  # forward work repeated before backward, comm included (0 without recompute)
    recompute_compute: float  # the GPU compute part of `recompute`
    tp_comm: float  # exposed TP communication inside forward + backward_input + recompute
    cp_comm: float  # exposed context-parallel KV exchange
    ep_comm: float  # expert-parallel all-to-all
    host_excess: float  # time the GPU waits on the CPU inside the three passes

    def __add__(self, other: PassCost) -> PassCost:  # type: ignore[override]  # fields, not concatenation
        return PassCost._make(map(operator.add, self, other))

    def scaled(self, factor: float) -> PassCost:
        return PassCost._make([a * factor for a in self])


ZERO_PASS = PassCost(*([0.0] * 9))
COMM_KINDS = ("tp", "cp", "ep")


class PassWork:
    """Accumulates GPU seconds, CPU kernel launches and exposed communication of one pass."""

    __slots__ = ("forward", "backward_input", "backward_weight", "forward_comm", "backward_comm",
                 "forward_kernels", "backward_kernels", "selective", "linear_forward", "host_wait", "synced_at")

    def __init__(self) -> None:
        self.forward = self.backward_input = self.backward_weight = 0.0
        self.forward_comm = {kind: 0.0 for kind in COMM_KINDS}
        self.backward_comm = {kind: 0.0 for kind in COMM_KINDS}
        self.forward_kernels = self.backward_kernels = 0
        self.selective = 0.0  # forward seconds that selective recompute repeats
        self.linear_forward = 0.0  # forward seconds of the block's linear layers
        self.host_wait = 0.0  # forward seconds the GPU idles after a host sync drained its queue (cost/moe_block.py)
        self.synced_at: tuple[float, int] | None = None  # forward (GPU seconds, kernels) issued before a host sync

    def host_sync(self) -> None:
        """The CPU waits here for the GPU to finish the forward so far (cost/moe_block.py): mark the split."""
        self.synced_at = (self.forward + sum(self.forward_comm.values()), self.forward_kernels)

    def gemm(self, device: Device, tokens: int, k: int, n: int, batch: int = 1,
             bias: bool = False, fp8: bool = False) -> tuple[float, float, float]:
        """A linear layer y[tokens, n] = x[tokens, k] W[k, n]: forward, dgrad (B) and wgrad (W) seconds.
        `fp8`: the three GEMMs run in FP8 when the device trains in FP8."""
        forward = gemm_time(device, tokens, n, k, batch, fp8)
        dgrad = gemm_time(device, tokens, k, n, batch, fp8)
        wgrad = gemm_time(device, k, n, tokens, batch, fp8)
        if bias:
            wgrad += elementwise_time(device, tokens * n * batch * device.element_bytes)
        self.forward += forward
        self.linear_forward += forward
        self.backward_input += dgrad
        self.backward_weight += wgrad
        self.forward_kernels += 1
        self.backward_kernels += 3 if bias else 2
        return forward, dgrad, wgrad

    def elementwise(self, device: Device, forward_bytes: float, backward_bytes: float,
                    forward_kernels: int = 1, backward_kernels: int = 1) -> None:
        self.forward += elementwise_time(device, forward_bytes, forward_kernels)
        self.backward_input += elementwise_time(device, backward_bytes, backward_kernels)
        self.forward_kernels += forward_kernels
        self.backward_kernels += backward_kernels

    def collective(self, kind: str, forward_seconds: float, backward_seconds: float) -> None:
        self.forward_comm[kind] += forward_seconds
        self.backward_comm[kind] += backward_seconds
        self.forward_kernels += 1 if forward_seconds else 0
        self.backward_kernels += 1 if backward_seconds else 0

    def finish(self, stack: SoftwareStack, recompute: str) -> PassCost:
        forward_comm = sum(self.forward_comm.values())
        forward_gpu = self.forward + forward_comm
        forward = with_host(forward_gpu, self.forward_kernels, stack)
        if self.synced_at is not None:
            forward = max(forward, synced_forward(forward_gpu, self.forward_kernels, self.synced_at, stack))
        forward += self.host_wait
        backward_gpu = self.backward_input + self.backward_weight + sum(self.backward_comm.values())
        backward = with_host(backward_gpu, self.backward_kernels, stack)
        # CPU-bound time lands on the input-gradient part; W keeps its pure GPU time.
        backward_input = backward - self.backward_weight
        excess = (forward - forward_gpu) + (backward - backward_gpu)
        redo = redo_compute = 0.0
        redo_share = 0.0  # how many forwards' worth of communication recompute repeats
        if recompute == "full":
            redo, redo_compute, redo_share = forward, self.forward, 1.0
            excess += forward - forward_gpu
        elif recompute == "selective":
            redo = redo_compute = self.selective
        tp, cp, ep = (self.forward_comm[k] * (1 + redo_share) + self.backward_comm[k] for k in COMM_KINDS)
        return PassCost(forward, backward_input, self.backward_weight, redo, redo_compute, tp, cp, ep, excess)


def with_host(gpu: float, kernels: int, stack: SoftwareStack) -> float:
    """A pass takes the slower of GPU work and CPU kernel issue, plus the part the two cannot overlap.

    Sync points inside a pass (blocking host-to-device copies, NCCL calls waiting for their peers) drain
    the GPU queue, after which the GPU waits for the CPU to refill it: a share `host_serialization` of
    the shorter of the two adds on top of the longer.
    """
    host = kernels * stack.host_seconds_per_kernel
    return max(gpu, host) + stack.host_serialization * min(gpu, host)


def synced_forward(gpu: float, kernels: int, synced_at: tuple[float, int], stack: SoftwareStack) -> float:
    """A forward pass with one host sync inside (the MoE dispatcher's token counts), as the repeating segment from
    one layer's sync to the next: the part after the sync (B: dispatch to combine) is issued into an empty GPU
    queue, the part before it (A: the next layer's attention and router) must finish before the next sync lets
    the CPU go on. The GPU cannot start B's kernels before the CPU issues them, nor the CPU pass the sync before
    the GPU ends A, so the segment takes max(C_B + max(C_A, G_A), G_B + G_A) (C: CPU issue seconds, G: GPU
    seconds), not max(C_A + C_B, G_A + G_B) as without a sync, when the CPU runs ahead across both."""
    gpu_a, kernels_a = synced_at
    host_a = kernels_a * stack.host_seconds_per_kernel
    host_b = (kernels - kernels_a) * stack.host_seconds_per_kernel
    return max(host_b + max(host_a, gpu_a), gpu)


def fp8_linear(work: PassWork, device: Device, stack: SoftwareStack, tokens: int, k: int, n: int,
               batch: int = 1, bias: bool = False) -> tuple[float, float, float]:
    """A block linear layer; under FP8 training its GEMMs run in FP8 with the stack's scaling recipe
    (cost/fp8.py; dynamic tensorwise by default: TorchTitan's Float8 / torchao, Megatron's current scaling) and
    the casts that scaling needs: the amax and cast of the input forward and of the output gradient backward
    (read 2 bytes for the amax, read 2 and write 1 for the cast: 5 bytes per element, 3 when compiled or fused
    kernels fold the amax into the producer), the FP8 transposes the dgrad and wgrad GEMMs need (1 byte read, 1
    written), and the weight's cast, which an FP8 all-gather does on the shard before gathering instead.
    Rowwise casts every operand once per GEMM axis instead of transposing; TE's delayed and blockwise recipes
    scale the whole (cost/fp8.py recipe_time_factor)."""
    if device.fp8_gemm_peak <= 0:
        return work.gemm(device, tokens, k, n, batch, bias)
    times = work.gemm(device, tokens, k, n, batch, bias, fp8=True)
    factor = recipe_time_factor(stack.fp8_recipe)
    if factor != 1.0:  # the recipe's GEMMs against the tensorwise ones costed above
        extra = [(factor - 1.0) * seconds for seconds in times]
        work.forward += extra[0]
        work.linear_forward += extra[0]
        work.backward_input += extra[1]
        work.backward_weight += extra[2]
        times = (factor * times[0], factor * times[1], factor * times[2])
    cast = 3.0 if stack.fused_elementwise else 5.0
    x, g, w = tokens * k * batch, tokens * n * batch, k * n * batch
    if stack.fp8_recipe == "rowwise":  # x and W along K forward; g and W along N, x and g along tokens backward
        work.elementwise(device, cast * (x + w), cast * (2 * g + x + w), 2, 4)
        return times
    weight_cast = 0.0 if gathers_fp8_weights(stack) else cast * w
    te_scale = factor if stack.fp8_recipe in ("delayed", "blockwise") else 1.0
    work.elementwise(device, te_scale * (cast * x + weight_cast), te_scale * (cast * g + 2.0 * (x + g + w)), 2, 4)
    return times


def mlp(work: PassWork, device: Device, stack: SoftwareStack, rows: int, hidden: int, width: int, swiglu: bool,
        batch: int = 1, bias: bool = False) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """An MLP on `rows` tokens (`batch` of them side by side: experts as one grouped GEMM): the up (and gate)
    projection, the activation (SwiGLU's product or GeLU) and the down projection; (up, down) GEMM times."""
    e = device.element_bytes
    up = fp8_linear(work, device, stack, rows, hidden, (2 if swiglu else 1) * width, batch, bias)
    forward, backward = (3 * e, 5 * e) if swiglu else (2 * e, 3 * e)
    work.elementwise(device, rows * batch * width * forward, rows * batch * width * backward)
    return up, fp8_linear(work, device, stack, rows, width, hidden, batch, bias)
