"""estimate(plan) -> Estimate: step time, throughput, MFU, bubble and per-rank memory of one plan.

How the step time is composed (the simulator replays exactly this from Estimate.stage_costs):
1. Every virtual stage i (model order) has a StageCost for ONE micro-batch: forward F_i, backward_input
   B_i (input gradients, plus the recompute forward when recompute != none), backward_weight W_i,
   send_activation C_i (its output to stage i+1; the gradient comes back in the same time; 0 for the last
   stage). The TP/CP/EP communication of a pass is inside its F/B (it is not overlapped).
2. Pipeline rank r runs the stages Plan.stages_of(r); its per-micro-batch work is
   (F_r, B_r, W_r) = the sums over those stages, and w_r = F_r + B_r + W_r.
3. pipeline_s = m * max_r w_r + bubble_s + pp_comm_s, with m = Plan.num_micro_batches and
      bubble_s  = (T(f, b, w) - m * mean_r w_r) * (sum_r w_r - max_r w_r) / ((p - 1) mean_r w_r)
      pp_comm_s = critical_hops(schedule, p, v, m, async p2p) * max_i C_i
   where T is pipeline.schedule_time: the longest path through torch's action order for identical
   stages with the mean per-chunk f, b, w (for 1F1B (m + p - 1) w, the (p-1)/m bubble of Narayanan et
   al. 2021; the zero-bubble schedules' own paths, see cost/pipeline.py). Interleaved and ZB-V ranks whose
   chunks differ: pipeline_s is the walk of torch's orders over the stage costs (pipeline.walked_pipeline),
   the simulator's critical path; the planner's Score (detail=False) keeps the closed form.
4. dp_comm_exposed_s = what data-parallel / ZeRO communication adds (cost/dataparallel.py): the same
   pipeline formula with every pass stretched by the gathers (and queued reductions) that hold it up,
   minus pipeline_s; plus once-per-step gathers that delay the first forward; plus reductions still
   running when the pipeline ends (after each rank's own finish) and the tied-embedding all-reduce.
5. step_time_s = pipeline_s + dp_comm_exposed_s + optimizer_s.
On a profiled CPU rank (Calibration.host) a stack with `eager_host_costs` becomes its CPU variant
(stack.on_host_profiled_cpu: nothing overlaps, one collective per FSDP module) and adds its measured host
costs in series (one thread computes and dispatches): each pass costs its eager ops (stack.eager_ops) x seconds
per op (DTensor's with tp > 1, and what each DTensor collective costs beyond the collective), plus the
FSDP2 hooks of each wrapped module (each block and each stage model) when dp > 1, and the memory traffic of its unfused element-wise ops beyond the fused kernels; the host side of every FSDP gather and reduction joins dp_comm_exposed_s, as do the
runtime's small per-step collectives (gradient norm, loss, metrics), and the optimizer pays a per-tensor
cost (cost/dataparallel.py).
Memory: a rank's peak = its model states (ZeRO; gradients stay whole when the stack reduces them only
once per step) + in-flight micro-batches x stored activations (cost/memory.py) + transient working
memory (ZeRO-3: the layers being gathered, or all of the rank's weights when they stay gathered between
passes) + the stack's reserved bytes; the plan fits when every rank's peak is within its device memory
less the headroom. What the stack does with gradients and weights is cost.stack.data_parallel_sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.cost.comm import Topology, p2p_time, topology_of
from fivefold.cost.dataparallel import (data_parallel_time, fsdp_host_time, optimizer_host_time, optimizer_time,
                                       parameter_tensors)
from fivefold.cost.flops import hardware_flops_per_step, model_flops_per_step
from fivefold.cost.host import bookkeeping_time, with_host_costs
from fivefold.cost.layer import padded_vocab
from fivefold.cost.layout import (Layout, RankEnv, layer_costs, layer_work, rank_envs, stage_owners,  # noqa: F401
                                  stage_params)
from fivefold.cost.memory import GIB, RankMemory, in_flight_chunks, zero_model_state_bytes
from fivefold.cost.pipeline import pipeline_time, walked_pipelines
from fivefold.cost.stack import STACKS, SoftwareStack, data_parallel_sync, on_host_profiled_cpu
from fivefold.spec.plan import Plan


@dataclass(frozen=True)
class StageCost:
    """One virtual stage, one micro-batch: seconds and bytes (see the module docstring)."""

    forward: float  # forward compute + its exposed (non-overlapped) TP/CP/EP communication
    backward_input: float  # input-gradient part of backward (+ the recompute forward when recompute != none)
    backward_weight: float  # weight-gradient part of backward
    send_activation: float  # p2p time of one micro-batch's activation to the next stage (gradient back: same)
    activation_bytes: float  # memory held per in-flight micro-batch on this stage
    static_bytes: float  # params + grads + optimizer states (+ embedding/LM head on first/last stage)
    layers: int = 0  # transformer layers in this stage
    pp_rank: int = 0  # the pipeline rank that runs it
    recompute: float = 0.0  # compute seconds of the recompute forward inside backward_input
    tp_comm: float = 0.0  # TP communication seconds inside forward + backward_input
    cp_comm: float = 0.0  # context-parallel communication seconds inside forward + backward_input
    ep_comm: float = 0.0  # expert-parallel all-to-all seconds inside forward + backward_input
    host_overhead: float = 0.0  # seconds the GPU waits on kernel launches inside the passes


@dataclass
class Estimate:
    """What one plan costs. All times in seconds per optimizer step unless named otherwise."""

    describe: str  # Plan.describe() of the plan
    world_size: int
    micro_batches: int  # per replica per step
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float  # model FLOPs (no recompute) per second per GPU, in TFLOP/s
    hardware_tflops_per_gpu: float  # including recompute
    mfu: float  # model FLOPs / (step time x world size x peak FLOP/s of the dtype)
    bubble_fraction: float  # share of the step the slowest pipeline rank idles in fill and drain
    fits: bool  # every rank's peak memory within its device memory less the headroom
    memory: RankMemory  # the rank with the highest peak
    peak_pp_rank: int  # which pipeline rank that is
    capacity_bytes: float  # usable device memory of that rank (after headroom)
    rank_memory: list[RankMemory]  # per pipeline rank
    stage_costs: list[StageCost]  # per virtual stage, model order
    pipeline_s: float
    bubble_s: float
    pp_comm_s: float
    dp_comm_s: float  # total data-parallel / ZeRO communication of one rank per step
    dp_comm_exposed_s: float  # the part not hidden behind compute
    optimizer_s: float
    breakdown_s: dict[str, float] = field(default_factory=dict)  # sums to step_time_s
    stack: str = "modern"
    notes: list[str] = field(default_factory=list)  # one line each: what the stack cannot run, extrapolation
    error_band: float | None = None  # expected relative error of the step time (development-set residuals)
    mfu_basis: str = ""  # which peak MFU is counted against ("bf16 peak" under fp8)

    def to_dict(self) -> dict:
        """The `fivefold estimate --json` object."""
        memory = self.memory.to_dict()
        return {
            "plan": self.describe, "world_size": self.world_size, "micro_batches": self.micro_batches,
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s / self.world_size,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction, "fits": self.fits,
            "memory_gib": {"peak_per_rank": memory.pop("peak"), **memory, "capacity": self.capacity_bytes / GIB,
                           "peak_pp_rank": self.peak_pp_rank,
                           "per_pp_rank": [round(m.total / GIB, 3) for m in self.rank_memory]},
            "breakdown_s": dict(self.breakdown_s),
            "dp_comm_s": self.dp_comm_s, "dp_comm_exposed_s": self.dp_comm_exposed_s,
            "optimizer_s": self.optimizer_s, "pipeline_s": self.pipeline_s, "stack": self.stack,
            "notes": list(self.notes), "error_band": self.error_band, "mfu_basis": self.mfu_basis,
            "stages": [{"pp_rank": s.pp_rank, "layers": s.layers, "forward_s": s.forward,
                        "backward_input_s": s.backward_input, "backward_weight_s": s.backward_weight,
                        "send_activation_s": s.send_activation, "activation_gib": s.activation_bytes / GIB,
                        "static_gib": s.static_bytes / GIB} for s in self.stage_costs],
        }


def estimate(plan: Plan, stack: SoftwareStack | None = None, headroom: float = 0.0) -> Estimate:
    """Predict one plan (see the module docstring for how the parts add up), with what makes it credible:
    the stack's missing features, extrapolation and the error band (cost/credibility.py)."""
    from fivefold.cost.credibility import annotate

    stack = stack or STACKS["modern"]
    return annotate(estimate_layout(Layout.of_plan(plan), stack, headroom, plan.describe()), plan, stack)


# --- the pieces -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Score:
    """What the planner ranks by: estimate_layout(..., detail=False)."""

    step_time_s: float
    peak_bytes: float  # the highest per-rank peak
    peak_ratio: float  # highest peak / usable memory of that rank (<= 1 fits)
    peak_pp_rank: int
    fits: bool


class RankGroup:
    """Pipeline ranks that do identical work: same layers, same ends of the model, same device."""

    __slots__ = ("ranks", "env", "layers", "first", "last", "chunks", "cost", "work", "dense", "expert",
                 "activation")

    def __init__(self, layout: Layout, stack: SoftwareStack, env: RankEnv, costs: tuple, layers: int,
                 first: bool, last: bool, chunks: int, extra_activation: float) -> None:
        layer, embedding, head, activation, _, per_chunk = costs
        self.ranks: list[int] = []  # shared with the cached pipeline shape: never mutate
        self.env, self.layers, self.first, self.last, self.chunks = env, layers, first, last, chunks
        cost = layer.scaled(layers) + per_chunk.scaled(chunks)
        if first:
            cost = cost + embedding
        if last:
            cost = cost + head
        self.cost = cost
        self.work = (cost.forward, cost.backward_input + cost.recompute, cost.backward_weight)
        # Stage params are linear in layers, so the rank's sum is one call with its totals.
        self.dense, self.expert = stage_params(layout, layers, first, last, holds_embedding=first)
        self.activation = layers * activation + (extra_activation if first else 0.0)


def estimate_layout(layout: Layout, stack: SoftwareStack, headroom: float = 0.0, describe: str = "",
                    detail: bool = True) -> Estimate | Score:
    """estimate() on a Layout (the planner's unvalidated form of a Plan); detail=False returns a Score.

    Work, parameters and activations of a pipeline rank are linear in its layer count plus the
    embedding / LM head it may hold, so ranks with equal (layers, ends, device) form one group and are
    costed once; the per-stage list is only built with detail=True.
    """
    topology = topology_of(layout.cluster)
    envs = rank_envs(layout, topology)
    if envs[0].device.host is not None:  # CPU ranks profiled with host costs: the stack's CPU variant
        stack = on_host_profiled_cpu(stack)
    p, m_batches = layout.pp, layout.num_micro_batches
    e = 4 if layout.train.dtype == "fp32" else 2
    tokens = layout.micro_batch * layout.train.seq_len // layout.cp
    activation_message = tokens * layout.model.hidden * e / layout.tp  # SP shard, or Megatron scatter-gather
    replica_shard = layout.dp * layout.cp
    expert_shard = max(1, replica_shard // layout.ep)
    dropout = stack.uses_dropout(layout.model)
    embedding_activation = tokens * layout.model.hidden * (e + (1 if dropout else 0)) / (
        layout.tp if layout.sequence_parallel else 1)  # the embedding output (and dropout mask) fed to layer 1
    owners = stage_owners(layout.schedule, p, layout.virtual_stages)
    block = layout.dp * layout.cp * layout.tp  # ranks per pipeline stage; rank_of(pp=r) = r * block
    first_ranks, hop_links, shapes = _pipeline_shape(layout, topology, envs, owners, block)
    # The slowest activation transfer between consecutive stages on different ranks.
    hop = max((p2p_time(activation_message, link) for link in hop_links), default=0.0)

    costs_of: dict[int, tuple] = {}
    ordered = []
    for layers, first, last, chunks, env, ranks in shapes:
        if id(env) not in costs_of:
            costs_of[id(env)] = with_host_costs(layout, env, stack, layer_costs(layout, env, stack))
        group = RankGroup(layout, stack, env, costs_of[id(env)], layers, first, last, chunks, embedding_activation)
        group.ranks = ranks
        ordered.append(group)

    members = [g.ranks for g in ordered]
    pipe = pipeline_time(layout.schedule, p, layout.virtual_stages, m_batches, [g.work for g in ordered], hop,
                         stack.async_p2p, members)
    data = data_parallel_time(layout, stack, ordered, topology, first_ranks[owners[0]], first_ranks[owners[-1]])
    held = pipe.total
    if any(s != g.work for s, g in zip(data.stretched, ordered)):
        held = pipeline_time(layout.schedule, p, layout.virtual_stages, m_batches, data.stretched, hop,
                             stack.async_p2p, members).total
    dp_exposed = held - pipe.total + data.head + data.tail
    if stack.eager_host_costs and any(g.env.device.host is not None for g in ordered):
        dp_exposed += max(fsdp_host_time(layout, stack, g.env, g.layers + g.chunks) for g in ordered)
        dp_exposed += bookkeeping_time(layout, topology, envs[0], [first_ranks[r] for r in range(p)])
    optimizer = max(optimizer_time(layout, g.env, g.dense, g.expert) + (optimizer_host_time(
        layout, g.env, parameter_tensors(layout.model, g.layers, g.first, g.last, g.first))
        if stack.eager_host_costs else 0.0) for g in ordered)
    step = pipe.total + dp_exposed + optimizer

    # Memory: a group peaks on its first rank (the one with the most micro-batches in flight).
    copies = stack.loss_fp32_copies + (stack.loss_parallel_fp32_copies if layout.tp > 1 else 0)
    vocab_share = layout.model.vocab if stack.tp_gathers_logits else padded_vocab(layout.model.vocab, layout.tp) / layout.tp
    logits = (4 * copies + e) * tokens * vocab_share
    if stack.pipeline_keeps_outputs and stack.pipeline_returns_outputs and p > 1:  # logits kept to be returned
        logits += (m_batches - 1) * kept_output_bytes(stack, e) * tokens * vocab_share
    sync = data_parallel_sync(stack, layout.zero, p)
    # FSDP2 with gradient sync off (pp > 1) accumulates the unsharded gradients in its reduce dtype.
    unsharded_grad_bytes = stack.gradient_bytes(layout.train.dtype) if stack.pipeline_defers_grad_sync else 0
    if detail:  # per-stage costs; where a rank's chunks differ, the pipeline walks torch's orders
        stages = _stage_list(layout, stack, envs, costs_of, owners, first_ranks, topology, activation_message,
                             embedding_activation, replica_shard, expert_shard, sync.grads_sharded,
                             unsharded_grad_bytes)
        held_by = {r: [h / w if w > 0 else 1.0 for h, w in zip(held_work, g.work)]
                   for g, held_work in zip(ordered, data.stretched) for r in g.ranks}
        walked, held_walked = walked_pipelines(
            pipe, held, layout.schedule, p, layout.virtual_stages, m_batches,
            [(s.forward, s.backward_input, s.backward_weight, s.send_activation) for s in stages], owners,
            [held_by[r] for r in owners], stack.async_p2p)
        dp_exposed += (held_walked - walked.total) - (held - pipe.total)
        pipe = walked
        step = pipe.total + dp_exposed + optimizer
    layer_weights = 2 * sum(stage_params(layout, 1, False, False)) * e if layout.zero == 3 else 0.0  # this + next
    if layout.train.dtype == "fp8":  # the computing layer's FP8 weight copy and its transpose (1 byte each)
        layer_weights += 2 * sum(stage_params(layout, 1, False, False))

    states: dict[int, list[float]] = {}

    def memory_parts(group: RankGroup, r: int) -> list[float]:
        if id(group) not in states:
            states[id(group)] = [a + b for a, b in zip(
                zero_model_state_bytes(group.dense, layout.train.dtype, layout.zero, replica_shard, sync.grads_sharded,
                                       unsharded_grad_bytes),
                zero_model_state_bytes(group.expert, layout.train.dtype, layout.zero, expert_shard,
                                       sync.grads_sharded, unsharded_grad_bytes))]
        parts = states[id(group)][:]
        chunks = in_flight_chunks(layout.schedule, p, layout.virtual_stages, m_batches, r)
        parts.append(chunks * group.activation / group.chunks)
        # ZeRO-3 holds the layers being gathered, or, kept gathered between passes, all of the rank's.
        gathered = (group.dense + group.expert) * e if sync.keeps_gathered else layer_weights
        working = costs_of[id(group.env)][4] + gathered + (logits if group.last else 0.0)
        if stack.pipeline_keeps_outputs and p > 1:  # receive buffers: input and output gradient, per micro-batch
            hops = 2 * group.chunks - (1 if group.first else 0) - (1 if group.last else 0)
            working += hops * m_batches * activation_message
        # The optimizer step runs after backward has freed the activations; its temporaries (torch's foreach
        # AdamW: one fp32 list the size of the rank's optimizer shard) set the peak when they outweigh them.
        if stack.optimizer_temporary_bytes:
            elements = parts[2] / (8.0 if layout.train.dtype == "fp32" else 12.0)
            working += max(0.0, stack.optimizer_temporary_bytes * elements - parts[3] - working)
        parts.append(working)
        parts.append(stack.reserved_bytes + stack.allocator_slack * (parts[3] + working))
        return parts

    peak_group, peak_parts, peak_ratio, fits = ordered[0], [], -1.0, True
    for group in ordered:
        parts = memory_parts(group, group.ranks[0])
        usable = group.env.capacity * (1 - headroom)
        fits = fits and sum(parts) <= usable
        if sum(parts) / usable > peak_ratio:
            peak_group, peak_parts, peak_ratio = group, parts, sum(parts) / usable
    if not detail:
        return Score(step, sum(peak_parts), peak_ratio, peak_group.ranks[0], fits)

    group_of_rank = {r: g for g in ordered for r in g.ranks}
    rank_memory = [RankMemory(*memory_parts(group_of_rank[r], r)) for r in range(p)]
    train, world = layout.train, layout.world_size
    model_flops = model_flops_per_step(layout.model, train)
    hardware_flops = hardware_flops_per_step(layout.model, train, layout.recompute)
    peak_sum = sum(envs[r].device.peak for r in range(p)) * (world // p)
    slowest = max(ordered, key=lambda g: sum(g.work)).cost
    comm = {kind: m_batches * getattr(slowest, kind) for kind in ("tp_comm", "cp_comm", "ep_comm")}
    recompute = m_batches * slowest.recompute_compute
    host = m_batches * slowest.host_excess
    compute = pipe.busy - sum(comm.values()) - recompute - host
    breakdown = {"compute": compute, "recompute": recompute, **comm, "host_overhead": host,
                 "pp_comm": pipe.p2p, "bubble": pipe.bubble, "dp_comm": dp_exposed, "optimizer": optimizer}
    return Estimate(
        describe=describe, world_size=world, micro_batches=m_batches, step_time_s=step,
        tokens_per_s=train.tokens_per_step / step, model_tflops_per_gpu=model_flops / step / world / 1e12,
        hardware_tflops_per_gpu=hardware_flops / step / world / 1e12, mfu=model_flops / (step * peak_sum),
        bubble_fraction=pipe.bubble / step, fits=fits, memory=RankMemory(*peak_parts),
        peak_pp_rank=peak_group.ranks[0], capacity_bytes=peak_group.env.capacity * (1 - headroom),
        rank_memory=rank_memory, stage_costs=stages, pipeline_s=pipe.total, bubble_s=pipe.bubble,
        pp_comm_s=pipe.p2p, dp_comm_s=data.total, dp_comm_exposed_s=dp_exposed, optimizer_s=optimizer,
        breakdown_s=breakdown, stack=stack.name)


def kept_output_bytes(stack: SoftwareStack, element_bytes: int) -> int:
    """Bytes per logit of each micro-batch's last-stage output that torch.distributed.pipelining keeps until
    the step ends (its schedules merge the outputs to return them): the model's output dtype, fp32 where
    the model upcasts its logits (TorchTitan's Llama, `output = self.output(h).float()`), else the
    training dtype."""
    return 4 if stack.logits_fp32_output else element_bytes


_SHAPES: dict[tuple, tuple] = {}


def _pipeline_shape(layout: Layout, topology: Topology, envs: list[RankEnv], owners: list[int],
                    block: int) -> tuple[list[int], list, list[tuple]]:
    """(first device of each pp rank, the distinct links between consecutive stages on different ranks,
    the rank groups as (layers, first, last, chunks, env, ranks)), cached: the planner asks for the same
    pipeline shape with many micro-batch sizes, ZeRO levels and recompute policies."""
    p = layout.pp
    key = (id(topology), id(envs), layout.schedule, p, layout.virtual_stages, block, layout.placement,
           layout.layers_per_stage)
    cached = _SHAPES.get(key)
    if cached is not None and cached[0] is topology and cached[1] is envs:
        return cached[2]
    first_ranks = [layout.placement[r * block] if layout.placement else r * block for r in range(p)]
    layers_of, chunks_of = [0] * p, [0] * p
    for owner, layers in zip(owners, layout.layers_per_stage):
        layers_of[owner] += layers
        chunks_of[owner] += 1
    links = {}
    for index in range(len(owners) - 1):
        a, b = owners[index], owners[index + 1]
        if a != b:
            da, db = first_ranks[a], first_ranks[b]
            link_key = (topology.node_of[da] == topology.node_of[db], topology.group_of[da], topology.group_of[db])
            if link_key not in links:
                links[link_key] = topology.pair_link(da, db)
    groups: dict[tuple, tuple] = {}
    for r in range(p):
        group_key = (layers_of[r], r == owners[0], r == owners[-1], chunks_of[r], id(envs[r]))
        if group_key not in groups:
            groups[group_key] = (*group_key[:4], envs[r], [])
        groups[group_key][5].append(r)
    if len(_SHAPES) > 8192:
        _SHAPES.clear()
    result = (first_ranks, list(links.values()), list(groups.values()))
    _SHAPES[key] = (topology, envs, result)
    return result


def _stage_list(layout: Layout, stack: SoftwareStack, envs: list[RankEnv], costs_of: dict, owners: list[int],
                first_ranks: list[int], topology: Topology, activation_message: float,
                embedding_activation: float, replica_shard: int, expert_shard: int,
                grads_sharded: bool, unsharded_grad_bytes: float = 0) -> list[StageCost]:
    """One StageCost per virtual stage, model order (identical stages are computed once)."""
    stages = []
    num_stages = len(owners)
    made: dict[tuple, dict] = {}
    for index, layers in enumerate(layout.layers_per_stage):
        r = owners[index]
        first, last = index == 0, index == num_stages - 1
        target = None if last or owners[index + 1] == r else first_ranks[owners[index + 1]]
        source = first_ranks[r]
        hop_key = None if target is None else (topology.node_of[source] == topology.node_of[target],
                                               topology.group_of[source], topology.group_of[target])
        key = (layers, first, last, id(envs[r]), r == owners[0], hop_key)
        fields = made.get(key)
        if fields is None:
            layer, embedding, head, activation, _, per_chunk = costs_of[id(envs[r])]
            cost = layer.scaled(layers) + per_chunk
            if first:
                cost = cost + embedding
            if last:
                cost = cost + head
            send = 0.0 if target is None else p2p_time(activation_message, topology.pair_link(source, target))
            dense, expert = stage_params(layout, layers, first, last, holds_embedding=r == owners[0])
            static = sum(zero_model_state_bytes(dense, layout.train.dtype, layout.zero, replica_shard,
                                                grads_sharded, unsharded_grad_bytes)) + sum(
                zero_model_state_bytes(expert, layout.train.dtype, layout.zero, expert_shard, grads_sharded,
                                       unsharded_grad_bytes))
            fields = made[key] = dict(
                forward=cost.forward, backward_input=cost.backward_input + cost.recompute,
                backward_weight=cost.backward_weight, send_activation=send,
                activation_bytes=layers * activation + (embedding_activation if first else 0.0),
                static_bytes=static, layers=layers, recompute=cost.recompute_compute,
                tp_comm=cost.tp_comm, cp_comm=cost.cp_comm, ep_comm=cost.ep_comm, host_overhead=cost.host_excess)
        stages.append(StageCost(pp_rank=r, **fields))
    return stages


