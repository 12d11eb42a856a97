"""Host costs of fivefold's eager PyTorch runtime on CPU ranks: what a step spends in Python, module
calls, the dispatcher, autograd, the FSDP2 and DTensor machinery and the one-tensor-at-a-time AdamW, apart
from arithmetic.

Everything is timed on the runtime's own code (fivefold.models, runtime/parallelize.py, runtime/optim.py)
at a negligible size (hidden 32, 8 tokens), so what is left is the per-op cost, not the work:
- op_forward / op_backward: a forward (with the runtime's loss) and a backward of a 2-layer Llama-style
  model, divided by the aten ops it dispatches (counted with a TorchDispatchMode, once, untimed);
- dtensor_op_*: the same model tensor-parallel (DTensor, sequence parallel) on a 1-rank mesh, divided by
  the plain model's op count: what DTensor's dispatch adds to every op, without any communication;
- tp_collective: the tensor-parallel model over 2 ranks, less the 1-rank one, per collective it issues,
  less a bare all-gather of the same size: what a DTensor collective costs beyond the collective;
- fsdp_unit_*: the model under fully_shard (the runtime's wrapping: each block and the root) with
  gradient sync off and the weights kept gathered, minus the plain model, per wrapped module: the hooks;
- fsdp_gather / fsdp_reduce: what FSDP's default (gather before every forward, reduce-scatter after every
  backward) over all N ranks adds to that, per wrapped module, less a bare all-gather / reduce-scatter of
  the same size: FSDP's own cost around each collective (the collective itself is in the curves);
- optimizer_tensor / optimizer_dtensor: the runtime's AdamW step and zero_grad per parameter tensor,
  plain and with FSDP's DTensor parameters;
- overlapped_collective: an asynchronous all-reduce of a DDP bucket's size issued before a GEMM loop
  about twice its length and waited for after it, against the loop alone, per second of the bare
  all-reduce's byte-moving part (its time less that of the smallest message): what of a reduction that
  "overlaps" the backward the backward still pays (copies and sums on the cores it computes on).
The caller runs this in every rank at once, so each measures what it gets while the others work too.
Loops that issue collectives run the same number of times on every rank (`agree`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.spec import ModelSpec
from fivefold.spec.cluster import HostCosts

# The runtime's default family (RoPE, RMSNorm, SwiGLU, grouped-query attention) at a negligible size.
PROBE_MODEL = ModelSpec(name="host-probe", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=32, vocab=16,
                        max_seq_len=16)
PROBE_TOKENS = (1, 8)  # batch, sequence
COLLECTIVE_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


class _CountOps(TorchDispatchMode):
    """Counts the aten ops, and among them the functional collectives, dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.collectives = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = str(func)
        self.collectives += "_c10d_functional" in name and any(op in name for op in COLLECTIVE_OPS)
        return func(*args, **(kwargs or {}))


def _probe(mode: str, mesh) -> torch.nn.Module:
    from fivefold.models import build_model, init_weights
    from fivefold.runtime.parallelize import apply_data_parallel, apply_tensor_parallel

    model = build_model(PROBE_MODEL, device="meta")
    if mode == "tp":
        apply_tensor_parallel(model, mesh, sequence_parallel=True)
    elif mode == "fsdp":
        apply_data_parallel(model, mesh, zero=1, param_dtype=None)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    return model


def _loss(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    logits = model(inputs[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), inputs[:, 1:].flatten(),
                                             reduction="sum") / inputs.numel()


class _Timer:
    """Median of `repeats` batches of about `seconds` each; the loop count is agreed by every rank, and
    every batch starts on all ranks at once and ends when the last is done (`line_up`, timed with it): with
    more ranks than cores, a rank that ran on after the others finished would time itself on a machine
    less shared than a training step's."""

    def __init__(self, seconds: float, repeats: int, agree: Callable[[int], int],
                 line_up: Callable[[], None] = lambda: None) -> None:
        self.seconds, self.repeats, self.agree, self.line_up = seconds, repeats, agree, line_up

    def loops(self, once: float) -> int:
        return self.agree(max(1, int(self.seconds / max(once, 1e-7))))

    def passes(self, model: torch.nn.Module, inputs: torch.Tensor) -> tuple[float, float]:
        """(forward, backward) seconds of one pass of `model`."""
        def once() -> tuple[float, float]:
            begin = time.perf_counter()
            loss = _loss(model, inputs)
            middle = time.perf_counter()
            loss.backward()
            return middle - begin, time.perf_counter() - middle

        forward, backward = self.parts(once)
        return forward, backward

    def parts(self, once: Callable[[], tuple[float, ...]]) -> tuple[float, ...]:
        """Medians over the batches of the per-call seconds of each part `once` times and returns, each batch
        stretched up to the last rank's end (line_up) in proportion to this rank's own time; the first call
        warms up (lazy init, first-call caches) and sets the loop count."""
        start = time.perf_counter()
        once()
        count = self.loops(time.perf_counter() - start)
        samples = []
        for _ in range(self.repeats):
            totals: list[float] | None = None
            self.line_up()
            begin = time.perf_counter()
            for _ in range(count):
                timed = once()
                totals = list(timed) if totals is None else [a + b for a, b in zip(totals, timed)]
            own = time.perf_counter() - begin
            self.line_up()
            stretch = (time.perf_counter() - begin) / own
            samples.append([stretch * total / count for total in totals or ()])
        return tuple(statistics.median(column) for column in zip(*samples))

    def call(self, work: Callable[[], object]) -> float:
        """Seconds of one call of `work`."""
        start = time.perf_counter()
        work()
        count = self.loops(time.perf_counter() - start)
        samples = []
        for _ in range(self.repeats):
            self.line_up()
            begin = time.perf_counter()
            for _ in range(count):
                work()
            self.line_up()
            samples.append((time.perf_counter() - begin) / count)
        return statistics.median(samples)


def _count_ops(model: torch.nn.Module, inputs: torch.Tensor) -> tuple[_CountOps, _CountOps]:
    forward, backward = _CountOps(), _CountOps()
    with forward:
        loss = _loss(model, inputs)
    with backward:
        loss.backward()
    return forward, backward


def _optimizer_seconds(model: torch.nn.Module, inputs: torch.Tensor, timer: _Timer) -> float:
    """AdamW step + zero_grad (as the runtime runs them) per parameter tensor."""
    from fivefold.runtime.optim import build_optimizer

    params = list(model.parameters())
    optimizer = build_optimizer(params, 1e-3)
    _loss(model, inputs).backward()
    grads = [p.grad for p in params]

    def step() -> None:
        for param, grad in zip(params, grads):
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timer.call(step) / len(params)


def _bare_collective(kind: str, group, elements: int, timer: _Timer) -> float:
    """One all-gather of `elements` per rank, or one reduce-scatter to that, over `group`."""
    ranks = dist.get_world_size(group)
    shard, full = torch.ones(elements), torch.ones(elements * ranks)
    if kind == "all_gather":
        return timer.call(lambda: dist.all_gather_single(full, shard, group=group))
    return timer.call(lambda: dist.reduce_scatter_single(shard, full, group=group))


def _middle_stage(layers: int) -> torch.nn.Module:
    """A pipeline stage model of `layers` probe layers that neither embeds nor has the head, as
    runtime/pipeline.py builds one: hidden states in, hidden states out."""
    from dataclasses import replace

    from fivefold.models import build_model, init_weights

    model = build_model(replace(PROBE_MODEL, layers=layers), device="meta")
    model.tok_embeddings = model.pos_embeddings = model.norm = model.output = None
    model.to_empty(device="cpu")
    init_weights(model, 0)
    return model


def _split_backward_extra(layers: int, timer: _Timer) -> float:
    """Seconds torch's split backward (stage_backward_input, then stage_backward_weight, as the
    zero-bubble schedules run every stage but the first) takes beyond one full backward, per micro-batch of
    a middle stage of `layers` layers; both backwards alternate in one loop so that they see the same load."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    model = _middle_stage(layers)
    hidden = torch.randn(PROBE_TOKENS[0], PROBE_TOKENS[1], PROBE_MODEL.hidden)
    grad = torch.randn_like(hidden)
    positions = torch.arange(PROBE_TOKENS[1])

    def extra() -> tuple[float]:
        stage_input = hidden.clone().requires_grad_(True)
        output = model(stage_input, positions=positions)
        begin = time.perf_counter()
        torch.autograd.backward(output, grad)
        full = time.perf_counter() - begin
        stage_input = hidden.clone().requires_grad_(True)
        output = model(stage_input, positions=positions)
        begin = time.perf_counter()
        _, groups = stage_backward_input([output], [grad], [stage_input], model.parameters())
        stage_backward_weight(model.parameters(), groups)
        split = time.perf_counter() - begin
        model.zero_grad(set_to_none=True)
        return (split - full,)

    return max(0.0, timer.parts(extra)[0])


OVERLAP_PROBE_BYTES = 16 << 20  # a DDP bucket (25 MB by default) and an FSDP2 block's gradients are this big
OVERLAP_PROBE_GEMM = 256


def _overlapped_collective(group, timer: _Timer) -> float:
    """overlapped_collective over `group` (module docstring); every rank runs the same loops."""
    message, latency_probe = torch.ones(OVERLAP_PROBE_BYTES // 4), torch.ones(1)
    left, right, product = (torch.randn(OVERLAP_PROBE_GEMM, OVERLAP_PROBE_GEMM) for _ in range(3))
    bare = timer.call(lambda: dist.all_reduce(message, group=group))
    floor = timer.call(lambda: dist.all_reduce(latency_probe, group=group))
    one_gemm = timer.call(lambda: torch.mm(left, right, out=product))
    gemms = timer.agree(max(1, int(2 * bare / max(one_gemm, 1e-7))))

    def compute() -> None:
        for _ in range(gemms):
            torch.mm(left, right, out=product)

    def overlapped() -> None:
        work = dist.all_reduce(message, group=group, async_op=True)
        compute()
        work.wait()

    alone = timer.call(compute)
    together = timer.call(overlapped)
    return max(0.0, together - alone) / max(bare - floor, 1e-7)


SPLIT_PROBE_LAYERS = 4  # with 1 layer: the per-layer and the per-pair terms apart (4 a + 6 b against a)


def measure_host_costs(alone_mesh, quick: bool, world_mesh=None, pair_mesh=None,
                       line_up: Callable[[], None] = lambda: None,
                       agree: Callable[[int], int] = lambda count: count) -> HostCosts:
    """HostCosts of this process. `alone_mesh`: a 1-rank DeviceMesh (this rank alone); `world_mesh`: all
    N ranks (None for one); `pair_mesh`: a 2-rank mesh for tensor parallelism (None without one);
    `line_up` a barrier so that every rank measures the same thing at the same time, `agree` the loop
    count every rank uses (rank 0's)."""
    timer = _Timer(*((0.05, 5) if quick else (0.2, 5)), agree, line_up)
    inputs = torch.randint(0, PROBE_MODEL.vocab, (PROBE_TOKENS[0], PROBE_TOKENS[1] + 1))
    plain = _probe("plain", alone_mesh)
    forward_ops, backward_ops = (count.ops for count in _count_ops(plain, inputs))
    line_up()
    forward, backward = timer.passes(plain, inputs)
    line_up()
    optimizer_tensor = _optimizer_seconds(plain, inputs, timer)
    tensor_parallel = _probe("tp", alone_mesh)
    line_up()
    tp_forward, tp_backward = timer.passes(tensor_parallel, inputs)
    tp_collective = 0.0
    if pair_mesh is not None:
        paired = _probe("tp", pair_mesh)
        collectives = sum(count.collectives for count in _count_ops(paired, inputs))
        line_up()
        pair_forward, pair_backward = timer.passes(paired, inputs)
        line_up()
        bare = _bare_collective("all_gather", pair_mesh.get_group(), PROBE_TOKENS[1] * PROBE_MODEL.hidden // 2, timer)
        tp_collective = max(0.0, (pair_forward + pair_backward - tp_forward - tp_backward) / collectives - bare)
    units = PROBE_MODEL.layers + 1  # each block and the root, as runtime/parallelize.py wraps them
    sharded = _probe("fsdp", world_mesh if world_mesh is not None else alone_mesh)
    line_up()
    gathering_forward, reducing_backward = timer.passes(sharded, inputs)
    line_up()
    optimizer_dtensor = _optimizer_seconds(sharded, inputs, timer)
    sharded.set_requires_gradient_sync(False)
    sharded.set_reshard_after_backward(False)
    line_up()
    hooks_forward, hooks_backward = timer.passes(sharded, inputs)
    bare_gather = bare_reduce = overlapped_collective = 0.0
    if world_mesh is not None:
        shard = PROBE_MODEL.params_per_layer() // world_mesh.size()
        line_up()
        bare_gather = _bare_collective("all_gather", world_mesh.get_group(), shard, timer)
        line_up()
        bare_reduce = _bare_collective("reduce_scatter", world_mesh.get_group(), shard, timer)
        line_up()
        overlapped_collective = _overlapped_collective(world_mesh.get_group(), timer)
    line_up()
    split_one = _split_backward_extra(1, timer)
    line_up()
    split_many = _split_backward_extra(SPLIT_PROBE_LAYERS, timer)
    pairs = SPLIT_PROBE_LAYERS * (SPLIT_PROBE_LAYERS - 1) / 2
    return HostCosts(
        split_backward_layer=split_one,
        split_backward_layer_pair=max(0.0, (split_many - SPLIT_PROBE_LAYERS * split_one) / pairs),
        op_forward=forward / forward_ops, op_backward=backward / backward_ops,
        dtensor_op_forward=tp_forward / forward_ops, dtensor_op_backward=tp_backward / backward_ops,
        tp_collective=tp_collective,
        fsdp_unit_forward=max(0.0, hooks_forward - forward) / units,
        fsdp_unit_backward=max(0.0, hooks_backward - backward) / units,
        fsdp_gather=max(0.0, (gathering_forward - hooks_forward) / units - bare_gather),
        fsdp_reduce=max(0.0, (reducing_backward - hooks_backward) / units - bare_reduce),
        optimizer_tensor=optimizer_tensor, optimizer_dtensor=optimizer_dtensor,
        overlapped_collective=overlapped_collective)
