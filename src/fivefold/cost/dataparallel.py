"""Data-parallel and ZeRO communication of a step, what of it holds up compute, and the optimizer.

Which collectives run when is cost.stack.data_parallel_sync's answer (shared with the simulator). Each
rank reduces and gathers on one communicator, one collective at a time. The estimate follows the same
mechanisms the simulator replays (sim/engine.py), in closed form per rank group:
- a pass whose weights were freed gathers them first, layer by layer (L layers, gather G): it starts
  after the first layer's share and cannot end before the gather plus one layer, so it is stretched by
  max(G/L, G - D (1 - 1/L)) (by G when gathers are not overlapped). Gradients reduced after every
  micro-batch make the next pass's gather queue behind the reduction: the weight-gradient pass D is
  stretched by max(R/L, R - D (1 - 1/L)). Stretched passes go through the pipeline formula, so they
  lengthen fill and drain too.
- gradients reduced once per step start with their stage's last weight-gradient pass (bucket by bucket,
  or after it while the rank waits); a rank's stages finish in the order its schedule runs them, and the
  rank itself finishes some time before the pipeline does (`_finishes`). Whatever of the queue outlasts
  the pipeline is exposed; so is a backlog of per-micro-batch reductions longer than the rank's work.
- weights gathered once per step (ZeRO-1/2) are all gathered from the start of the step, in the order the
  first rank first uses its stages.
- tied embeddings with pp > 1: the first and last stages all-reduce the embedding gradient when both
  are done.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.cost.comm import Topology, all_gather_time, all_reduce_time, reduce_scatter_time
from fivefold.cost.fp8 import gathers_fp8_weights
from fivefold.cost.host import ddp_on_cpu
from fivefold.cost.layer import padded_vocab
from fivefold.cost.layout import Layout, RankEnv, RankGroup
from fivefold.cost.moe import moe_share
from fivefold.cost.stack import DataParallelSync, SoftwareStack, data_parallel_sync
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import SPLIT_BACKWARD

# Adam step traffic per parameter on its rank (multi-tensor apply, memory-bound): read fp32 master,
# momentum, variance and the gradient, write the three back and the 16-bit weight copy, plus the
# gradient-norm and unscale passes: ~36 bytes; fp16 adds the fp16 -> fp32 gradient copy of Megatron's
# loss-scaling optimizer (~8 more).
OPTIMIZER_BYTES_PER_PARAM = {"bf16": 36.0, "fp16": 44.0, "fp32": 36.0, "fp8": 36.0}


def optimizer_time(layout: Layout, env: RankEnv, dense: float, expert: float) -> float:
    """Adam over this rank's (ZeRO-sharded) parameters: a memory-bound sweep."""
    if layout.zero >= 1:
        shard = layout.dp * layout.cp
        dense, expert = dense / shard, expert / env.expert_replicas.size  # experts: over edp (folding)
    return (dense + expert) * OPTIMIZER_BYTES_PER_PARAM[layout.train.dtype] / env.device.bandwidth


def parameter_tensors(model: ModelSpec, layers: int, first: bool, last: bool, holds_embedding: bool = False) -> int:
    """Parameter tensors of a stage (the optimizer's per-tensor work), as fivefold.models builds them:
    per block the q, k, v, o projections (with biases in LayerNorm blocks), the MLP (SwiGLU: three
    matrices; GeLU: two with biases) and two norms (LayerNorm: weight and bias); the embedding tables
    on the first stage, the final norm and (untied, or tied but elsewhere) the LM head on the last. An MoE
    block has the router, the stacked experts' matrices and the shared experts' (no biases) instead of the
    MLP; a mixed model's stage is counted with its share of MoE blocks."""
    norm_tensors = 2 if model.norm == "layernorm" else 1
    attention = 4 * norm_tensors  # a bias per projection exactly when the norms have one
    matrices = 3 if model.mlp == "swiglu" else 2
    mlp = 3 if model.mlp == "swiglu" else 4
    share = moe_share(model)
    if share > 0:
        mlp = round(share * (1 + matrices * (1 + (model.shared_experts > 0))) + (1 - share) * mlp)
    tensors = layers * (attention + mlp + 2 * norm_tensors)
    if first:
        tensors += 1 + (model.position == "learned")
    if last:
        tensors += norm_tensors + (0 if model.tied_embeddings and (first or holds_embedding) else 1)
    return tensors


def optimizer_host_time(layout: Layout, env: RankEnv, tensors: int) -> float:
    """The host side of the runtime's AdamW on a profiled CPU rank: one tensor at a time (torch has no
    foreach kernels on CPU), dearer per tensor when the parameters are DTensors (dp > 1 under FSDP2 or
    replicate, or tp > 1); DistributedDataParallel (host.ddp_on_cpu) keeps them plain tensors."""
    host = env.device.host
    if host is None:
        return 0.0
    distributed = (layout.dp * layout.cp > 1 and not ddp_on_cpu(layout)) or layout.tp > 1
    return tensors * (host.optimizer_dtensor if distributed else host.optimizer_tensor)


def fsdp_host_time(layout: Layout, stack: SoftwareStack, group: RankGroup) -> float:
    """Host side of the FSDP2 / replicate collectives of one step on a profiled CPU rank, in series with its
    work: every wrapped module (each block and each stage model) gathers and reduces on its own, as often
    as the data-parallel schedule says, and FSDP2 copies the weights in and out around each gather and the
    gradients around each reduction (the collectives' own time is in data_parallel_time)."""
    host = group.env.device.host
    if host is None or layout.dp * layout.cp <= 1:
        return 0.0
    units = group.layers + group.chunks
    reduce, gather = units * host.fsdp_reduce, units * host.fsdp_gather
    if layout.zero >= 1:
        # FSDP2 copies in and out around each collective: the whole tensor and its shard, each read and
        # written once (all_gather_copy_in + split_with_sizes_copy; chunk_cat + the shard's accumulation).
        grad_bytes, weight_bytes = _sync_bytes(layout, stack)
        for params, link in ((group.dense, group.env.replicas), (group.expert, group.env.expert_replicas)):
            if params > 0 and link.size > 1:
                copied = 2 * params * (1 + 1 / link.size) / group.env.device.bandwidth
                reduce, gather = reduce + copied * grad_bytes, gather + copied * weight_bytes
    policy = data_parallel_sync(stack, layout.zero, layout.pp)
    return _total(policy, reduce, gather, layout.num_micro_batches, layout.pp)


def sync_seconds(layout: Layout, stack: SoftwareStack, env: RankEnv, dense: float,
                 expert: float, modules: int = 1) -> tuple[float, float]:
    """(one gradient reduction, one weight all-gather) of these parameters over the rank's replicas,
    in `modules` equal collectives (stack.collective_per_module: one per wrapped module).

    ZeRO-0 all-reduces the gradients; ZeRO >= 1 reduce-scatters them and all-gathers the weights."""
    grad_bytes, weight_bytes = _sync_bytes(layout, stack)
    reduce = gather = 0.0
    for params, link in ((dense, env.replicas), (expert, env.expert_replicas)):
        if params <= 0 or link.size <= 1:
            continue
        piece = params / modules
        if layout.zero == 0:
            reduce += modules * all_reduce_time(piece * grad_bytes, link)
        else:
            reduce += modules * reduce_scatter_time(piece * grad_bytes, link)
            gather += modules * all_gather_time(piece * weight_bytes, link)
    return reduce, gather


def in_series_reduction(layout: Layout, stack: SoftwareStack, group: RankGroup, modules: int,
                        reduce: float) -> float:
    """Seconds of an overlapped gradient reduction (`reduce`, the rank's collectives) that its passes still
    pay on a profiled CPU rank: the measured overlapped_collective factor times the collectives' byte-moving
    part (less what the same collectives of one element take, their latency, which does overlap)."""
    host = group.env.device.host
    if host is None or host.overlapped_collective <= 0 or reduce <= 0:
        return 0.0
    latency, _ = sync_seconds(layout, stack, group.env, modules if group.dense > 0 else 0,
                              modules if group.expert > 0 else 0, modules)
    return host.overlapped_collective * max(0.0, reduce - latency)


def _sync_bytes(layout: Layout, stack: SoftwareStack) -> tuple[int, int]:
    """(bytes per gradient element reduced, bytes per weight element gathered)."""
    weight_bytes = 4 if layout.train.dtype == "fp32" else 2
    if layout.train.dtype == "fp8" and gathers_fp8_weights(stack) and layout.zero == 3:
        weight_bytes = 1  # FSDP2 gathers the block weights already cast to FP8 (torchao's FP8 all-gather)
    return stack.gradient_bytes(layout.train.dtype), weight_bytes


def tied_embedding_seconds(layout: Layout, stack: SoftwareStack, topology: Topology, first_device: int,
                           last_device: int) -> float:
    """All-reduce of the tied embedding gradient between the first and the last stage (pp > 1); none under
    vocabulary parallelism, where each rank's embedding and head rows are the same rows (cost/vocab.py)."""
    model = layout.model
    if not model.tied_embeddings or layout.pp <= 1 or getattr(layout, "vocab_parallel", False):
        return 0.0
    link = topology.pair_link(first_device, last_device)
    grad_bytes = stack.gradient_bytes(layout.train.dtype)
    return all_reduce_time(padded_vocab(model.vocab, layout.tp) * model.hidden / layout.tp * grad_bytes, link)


@dataclass(frozen=True)
class DataParallelCost:
    total: float  # data-parallel communication seconds of the busiest rank per step
    stretched: list[tuple[float, float, float]]  # per rank group: (F, B, W) with what holds compute up
    head: float  # exposed before the first forward can run (once-per-step gathers)
    tail: float  # exposed after the pipeline ends (reductions still running, tied-embedding all-reduce)


def _finishes(schedule: str, p: int, v: int, r: int, f: float, b: float, w: float) -> list[tuple[float, float]]:
    """(how long before the pipeline ends, duration) of each of rank r's stages' last weight-gradient
    pass, earliest first, for identical stages with per-chunk f, b (input gradient), w; measured on the
    simulator's replay of the torch orders (1F1B: rank r ends r backwards before rank 0)."""
    if p <= 1:
        return [(0.0, w if schedule in SPLIT_BACKWARD else b + w)]
    if schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        return [(r * (b + w) + chunk * p * (b + w), b + w) for chunk in reversed(range(v))]
    if schedule == "zb-h1":  # deferred W passes fill the drain; the slower of B and W sets the stagger
        return [(r * (b - w) if b >= w else (p - 1 - r) * (w - b), w)]
    # zbv: rank r's second stage (2p-1-r) ends r W passes before its first; rank 0's runs p steps earlier.
    slack = r * (b - 2 * w) if b >= 2 * w else (p - 1 - r) * min(2 * w - b, w)
    return [(slack + (p * (b + w) if r == 0 else r * w), w), (slack, w)]


def _queue_end(finishes: list[tuple[float, float]], reduce: float, layers: float, overlapped: bool) -> float:
    """When the rank's reductions (`reduce` per stage) end, relative to the pipeline's end."""
    free, delay = float("-inf"), 0.0
    for before_end, duration in finishes:
        end = delay - before_end
        if overlapped:  # buckets ready one by one during the pass
            start = max(free, end - duration + duration / layers)
            free = max(start + reduce, end + reduce / layers)
        else:  # after the pass; the rank waits, so its later passes slip
            free = max(free, end) + reduce
            delay += free - end
    return free


def data_parallel_time(layout: Layout, stack: SoftwareStack, groups: list[RankGroup], topology: Topology,
                       first_device: int, last_device: int) -> DataParallelCost:
    """The data-parallel terms of a step (module docstring), per rank group."""
    policy = data_parallel_sync(stack, layout.zero, layout.pp)
    p, v, m = layout.pp, layout.virtual_stages, layout.num_micro_batches
    split = layout.schedule in SPLIT_BACKWARD
    per_pass, in_passes = _gathers_per_pass(policy), _reduces_in_passes(policy)
    tied = tied_embedding_seconds(layout, stack, topology, first_device, last_device)
    total = head = 0.0
    tail, ends_tail = float("-inf"), float("-inf")
    stretched = []
    for group in groups:
        forward, backward_input, backward_weight = group.work
        modules = group.layers + group.chunks if stack.collective_per_module else 1
        reduce, gather = sync_seconds(layout, stack, group.env, group.dense, group.expert, modules)
        # In series with the passes: what of an overlapped reduction the rank's cores still do (CPU ranks).
        series = in_series_reduction(layout, stack, group, modules, reduce) if policy.reduce_overlapped else 0.0
        ends = group.first or group.last
        if reduce <= 0 and gather <= 0 and not (ends and tied > 0):
            stretched.append(group.work)
            continue
        chunks = group.chunks
        f, b, w = forward / chunks, backward_input / chunks, backward_weight / chunks
        layers = max(1.0, group.layers / chunks)
        reduce_c, gather_c = max(0.0, reduce - series) / chunks, gather / chunks  # what is left to overlap
        total = max(total, _total(policy, reduce, gather, m, p) + (tied if ends else 0.0))
        work = group.work
        if (per_pass and gather > 0) or (in_passes and reduce_c > 0):
            work = held_passes(policy, work, chunks, f, b, w, layers, reduce_c, gather_c, split, m, p)
        if series > 0 and in_passes:  # every micro-batch's reduction
            work = (work[0], work[1], work[2] + series) if split else (work[0], work[1] + series, work[2])
        stretched.append(work)
        if policy.gathers_once and group.ranks[0] == 0:
            head = _head(layout.schedule, p, v, f, layers, gather_c, policy.gather_overlapped)
        group_tail = float("-inf")
        for r in (group.ranks[0], group.ranks[-1]) if len(group.ranks) > 1 else (group.ranks[0],):
            finishes = _finishes(layout.schedule, p, v, r, f, b, w)
            ready = -finishes[-1][0]  # the rank's own last pass
            if reduce_c > 0 and not in_passes:
                ready = max(ready, _queue_end(finishes, reduce_c, layers, policy.reduce_overlapped))
                if policy.reduce_every_micro_batch:  # reductions longer than the rank's work pile up
                    ready += (m - 1) * max(0.0, reduce - forward - backward_input - backward_weight)
            if series > 0 and not in_passes:
                ready += series
            group_tail = max(group_tail, ready)
        tail = max(tail, group_tail)
        if ends:
            ends_tail = max(ends_tail, group_tail)
    if tied > 0:
        tail = max(tail, ends_tail + tied)
    return DataParallelCost(total, stretched, head, max(0.0, tail))


def _gathers_per_pass(policy: DataParallelSync) -> bool:
    return policy.gathers_weights and not policy.gathers_once


def _reduces_in_passes(policy: DataParallelSync) -> bool:
    """Per-micro-batch reductions hold up compute: the rank waits for them, or the next gather does."""
    return policy.reduce_every_micro_batch and (_gathers_per_pass(policy) or not policy.reduce_overlapped)


def _total(policy: DataParallelSync, reduce: float, gather: float, m: int, p: int) -> float:
    """Seconds of collectives one rank runs per step."""
    reduces = m if policy.reduce_every_micro_batch else 1
    if not policy.gathers_weights:
        gathers = 0
    elif policy.gathers_once:
        gathers = 1
    elif policy.reshard_after_forward and policy.reshard_after_backward:
        gathers = 2 * m
    else:
        gathers = m + (min(m, p) if policy.reshard_after_forward else 0)  # kept gathered: warm-up forwards
    return reduces * reduce + gathers * gather


def held_passes(policy: DataParallelSync, work: tuple[float, float, float], chunks: int, f: float, b: float,
               w: float, layers: float, reduce: float, gather: float, split: bool, m: int,
               p: int) -> tuple[float, float, float]:
    """The rank's (F, B, W) per micro-batch with what holds each pass up: its gather when its weights
    were freed (one per chunk, f/b/w per chunk over `layers` layers), and the previous pass's reduction
    when that blocks the rank or queues before the next gather (module docstring)."""
    def stretch(seconds: float, duration: float, overlapped: bool) -> float:
        if not overlapped:
            return seconds
        return max(seconds / layers, seconds - duration * (1 - 1 / layers))

    gathering_backward = b if split else b + w
    extra_f = extra_b = extra_w = 0.0
    if policy.reshard_after_forward:  # every backward finds its weights freed by the forward before it
        extra_b = stretch(gather, gathering_backward, policy.gather_overlapped)
    if policy.reshard_after_backward:  # every forward after a backward gathers
        extra_f = stretch(gather, f, policy.gather_overlapped)
    elif policy.reshard_after_forward:  # kept from a backward to the next forward: only warm-up forwards
        extra_f = stretch(gather, f, policy.gather_overlapped) * min(1.0, p / m)
    if _reduces_in_passes(policy):  # the rank, or the next pass's gather, waits for this reduction
        weight_pass = w if split else b + w
        queued = stretch(reduce, weight_pass, policy.reduce_overlapped)
        if split:
            extra_w = queued
        else:
            extra_b += queued
    forward, backward_input, backward_weight = work
    return (forward + chunks * extra_f, backward_input + chunks * extra_b, backward_weight + chunks * extra_w)


def _head(schedule: str, p: int, v: int, f: float, layers: float, gather: float, overlapped: bool) -> float:
    """Delay of the pipeline's start: rank 0 gathers its stages one after another from t=0 and uses
    stage j first after j rounds of forwards (p per round interleaved, 2p - 1 for the V)."""
    per_round = {"interleaved-1f1b": p, "zbv": 2 * p - 1}.get(schedule, 0)
    delay = 0.0
    for chunk in range(v if per_round else 1):
        ready = (chunk + 1) * gather  # this stage's gather is done
        first_use = chunk * per_round * f
        if overlapped:
            delay = max(delay, gather / layers if chunk == 0 else 0.0, ready - first_use - f * (1 - 1 / layers))
        else:
            delay = max(delay, ready - first_use)
    return delay
