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
(host.stack_on_profiled_cpu: one collective per FSDP module, reductions overlapped only where the runtime
overlaps them on gloo) and adds its measured host costs in series (one thread computes and dispatches):
each pass costs its eager ops (cost/eager_ops.py) x seconds per op (DTensor's with tp > 1, and what each
DTensor collective costs beyond the collective), plus the FSDP2 hooks of each wrapped module (each block and
each stage model) when dp > 1, and the memory traffic of its unfused element-wise ops beyond the fused
kernels; the zero-bubble schedules' split backward adds its graph walks to the W pass of every stage but
the first (host.split_backward_host); the host side of every FSDP gather and reduction joins
dp_comm_exposed_s, as do the runtime's small per-step collectives (gradient norm, loss, metrics), and the
optimizer pays a per-tensor cost (cost/dataparallel.py).
Memory: a rank's peak = its model states (ZeRO; gradients stay whole when the stack reduces them only
once per step) + in-flight micro-batches x stored activations (cost/memory.py) + transient working
memory (ZeRO-3: the layers being gathered, or all of the rank's weights when they stay gathered between
passes) + the stack's reserved bytes; the plan fits when every rank's peak is within its device memory
less the headroom. What the stack does with gradients and weights is cost.stack.data_parallel_sync.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from fivefold.cost.comm import GroupLink, Topology, p2p_time, topology_of
from fivefold.cost.dataparallel import (data_parallel_time, fsdp_host_time, optimizer_host_time, optimizer_time,
                                       parameter_tensors)
from fivefold.cost.flops import hardware_flops_per_step, model_flops_per_step
from fivefold.cost.fp8 import gathers_fp8_weights
from fivefold.cost.host import (bookkeeping_time, ddp_on_cpu, split_backward_host, stack_on_profiled_cpu,
                                 with_host_costs)
from fivefold.cost.layer import padded_vocab
from fivefold.cost.layout import (Layout, LayerCosts, RankEnv, RankGroup, layer_costs, rank_envs,
                                  stage_owners, stage_params)
from fivefold.cost.memory import RankMemory, in_flight_chunks, zero_model_state_bytes
from fivefold.cost.moe_breakdown import with_moe_parts
from fivefold.cost.pipeline import PipelineTime, pipeline_time, walked_pipelines
from fivefold.cost.pipeline_shape import pipeline_shape
from fivefold.cost.results import Estimate, Score, StageCost
from fivefold.cost.stack import DEFAULT_STACK, STACKS, DataParallelSync, SoftwareStack, data_parallel_sync
from fivefold.cost.vocab import pp_group_link, vocab_parallel_comm
from fivefold.spec.plan import Plan


def estimate(plan: Plan, stack: SoftwareStack | None = None, headroom: float = 0.0) -> Estimate:
    """Predict one plan (see the module docstring for how the parts add up), with what makes it credible:
    the stack's missing features, extrapolation and the error band (cost/credibility.py)."""
    from fivefold.cost.credibility import annotate

    stack = stack or STACKS[DEFAULT_STACK]
    return annotate(estimate_layout(Layout.of_plan(plan), stack, headroom, plan.describe()), plan, stack)


class _RankGroups(NamedTuple):
    """What the step time and the memory of a Layout are both built from (see _rank_groups)."""

    stack: SoftwareStack  # the stack costed with (on profiled CPU ranks the stack's CPU variant)
    topology: Topology
    envs: list[RankEnv]  # per pipeline rank
    owners: Sequence[int]  # the pp rank of every virtual stage
    first_ranks: list[int]  # the first device of every pp rank
    hop_links: list[GroupLink]  # the distinct links between consecutive stages on different ranks
    groups: list[RankGroup]  # pipeline ranks that do identical work, in pipeline order of their first rank
    costs_of: dict[int, LayerCosts]  # by id() of a RankEnv
    element_bytes: int
    tokens: int  # per micro-batch on one rank
    activation_message: float  # bytes of one activation sent between stages
    embedding_activation: float  # the embedding output (and dropout mask) fed to layer 1
    replica_shard: int  # ranks a dense parameter is sharded over under ZeRO
    expert_shard: int  # ... an expert parameter
    sync: DataParallelSync
    unsharded_grad_bytes: float  # per parameter, when FSDP2 accumulates unsharded gradients (pp > 1)


class _StepTime(NamedTuple):
    pipe: PipelineTime
    dp_comm_s: float
    dp_exposed_s: float
    optimizer_s: float
    step_s: float
    stages: list[StageCost]  # per virtual stage (detail only)


class _Memory(NamedTuple):
    parts_of: Callable[[RankGroup, int], list[float]]  # a group's memory on one of its ranks (RankMemory's)
    peak_group: RankGroup  # the group whose first rank is fullest relative to its memory
    peak_parts: list[float]
    peak_ratio: float
    fits: bool


def score_layout(layout: Layout, stack: SoftwareStack, headroom: float = 0.0, time_if_overflowing: bool = True
                 ) -> Score:
    """What the planner ranks by: the step time and the fullest rank's memory, without per-stage detail.
    With `time_if_overflowing` False a layout that does not fit is not timed (step_time_s is inf): the
    planner needs only that from its leaner variants, and memory costs a fraction of the time."""
    ranks = _rank_groups(layout, stack)
    memory = _memory(layout, ranks, headroom)
    step = _step_time(layout, ranks, detail=False).step_s if memory.fits or time_if_overflowing else float("inf")
    return Score(step, sum(memory.peak_parts), memory.peak_ratio, memory.peak_group.ranks[0], memory.fits)


def estimate_layout(layout: Layout, stack: SoftwareStack, headroom: float = 0.0, describe: str = "") -> Estimate:
    """estimate() on a Layout: the step with per-stage costs, per-rank memory, MFU and the time breakdown."""
    ranks = _rank_groups(layout, stack)
    time, memory = _step_time(layout, ranks, detail=True), _memory(layout, ranks, headroom)
    p, m_batches, pipe, step = layout.pp, layout.num_micro_batches, time.pipe, time.step_s
    group_of_rank = {r: g for g in ranks.groups for r in g.ranks}
    rank_memory = [RankMemory(*memory.parts_of(group_of_rank[r], r)) for r in range(p)]
    train, world = layout.train, layout.world_size
    model_flops = model_flops_per_step(layout.model, train)
    hardware_flops = hardware_flops_per_step(layout.model, train, layout.recompute)
    peak_sum = sum(ranks.envs[r].device.peak for r in range(p)) * (world // p)
    slowest = (slowest_group := max(ranks.groups, key=lambda g: sum(g.work))).cost
    comm = {kind: m_batches * getattr(slowest, kind) for kind in ("tp_comm", "cp_comm", "ep_comm")}
    recompute = m_batches * slowest.recompute_compute
    host = m_batches * slowest.host_excess
    if layout.vocab_parallel and p > 1:  # the collectives of vocabulary parallelism, named (cost/vocab.py)
        comm["vocab_comm"] = m_batches * vocab_parallel_comm(
            layout, pp_group_link(layout, ranks.topology), ranks.element_bytes).total
    compute = pipe.busy - sum(comm.values()) - recompute - host
    breakdown = {"compute": compute, "recompute": recompute, **comm, "host_overhead": host, "pp_comm": pipe.p2p,
                 "bubble": pipe.bubble, "dp_comm": time.dp_exposed_s, "optimizer": time.optimizer_s}
    return with_moe_parts(Estimate(  # the MoE terms of compute and memory named (cost/moe_breakdown.py)
        describe=describe, world_size=world, micro_batches=m_batches, step_time_s=step,
        tokens_per_s=train.tokens_per_step / step, model_tflops_per_gpu=model_flops / step / world / 1e12,
        hardware_tflops_per_gpu=hardware_flops / step / world / 1e12, mfu=model_flops / (step * peak_sum),
        bubble_fraction=pipe.bubble / step, fits=memory.fits, memory=RankMemory(*memory.peak_parts),
        peak_pp_rank=memory.peak_group.ranks[0], capacity_bytes=memory.peak_group.env.capacity * (1 - headroom),
        rank_memory=rank_memory, stage_costs=time.stages, pipeline_s=pipe.total, bubble_s=pipe.bubble,
        pp_comm_s=pipe.p2p, dp_comm_s=time.dp_comm_s, dp_comm_exposed_s=time.dp_exposed_s,
        optimizer_s=time.optimizer_s, breakdown_s=breakdown, stack=ranks.stack.name),
        layout, slowest_group, memory.peak_group, ranks.stack, ranks.element_bytes)


def _rank_groups(layout: Layout, stack: SoftwareStack) -> _RankGroups:
    """The pipeline ranks of a Layout (the planner's unvalidated form of a Plan) in groups, with what their
    time and memory share.

    Work, parameters and activations of a pipeline rank are linear in its layer count plus the
    embedding / LM head it may hold, so ranks with equal (layers, ends, device) form one group and are
    costed once.
    """
    topology = topology_of(layout.cluster)
    envs = rank_envs(layout, topology)
    if envs[0].device.host is not None:  # CPU ranks profiled with host costs: the stack's CPU variant
        stack = stack_on_profiled_cpu(layout, stack)
    p = layout.pp
    e = 4 if layout.train.dtype == "fp32" else 2
    tokens = layout.micro_batch * layout.train.seq_len // layout.cp
    activation_message = tokens * layout.model.hidden * e / layout.tp  # SP shard, or Megatron scatter-gather
    replica_shard = layout.dp * layout.cp
    expert_shard = envs[0].expert_replicas.size  # edp: ranks holding the same expert slice (folding)
    dropout = stack.uses_dropout(layout.model)
    embedding_activation = tokens * layout.model.hidden * (e + (1 if dropout else 0)) / (
        layout.tp if layout.sequence_parallel else 1)  # the embedding output (and dropout mask) fed to layer 1
    owners = stage_owners(layout.schedule, p, layout.virtual_stages)
    block = layout.dp * layout.cp * layout.tp  # ranks per pipeline stage; rank_of(pp=r) = r * block
    first_ranks, hop_links, shapes = pipeline_shape(layout, topology, envs, owners, block)

    costs_of: dict[int, LayerCosts] = {}
    ordered = []
    for layers, first, last, chunks, env, ranks in shapes:
        if id(env) not in costs_of:
            costs_of[id(env)] = with_host_costs(layout, env, stack, layer_costs(layout, env, stack))
        # The first stage's W pass is one full backward, the others' split (on a profiled CPU).
        split = split_backward_host(layout, env, stack, layers / chunks, chunks - (1 if first else 0))
        group = RankGroup(layout, stack, env, costs_of[id(env)], layers, first, last, chunks, embedding_activation,
                          split)
        group.ranks = ranks
        ordered.append(group)
    # FSDP2 with gradient sync off (pp > 1) accumulates the unsharded gradients in its reduce dtype.
    unsharded_grad_bytes = stack.gradient_bytes(layout.train.dtype) if stack.pipeline_defers_grad_sync else 0
    return _RankGroups(stack, topology, envs, owners, first_ranks, hop_links, ordered, costs_of, e, tokens,
                       activation_message, embedding_activation, replica_shard, expert_shard,
                       data_parallel_sync(stack, layout.zero, p), unsharded_grad_bytes)


def _step_time(layout: Layout, ranks: _RankGroups, detail: bool) -> _StepTime:
    """The step time of the grouped ranks; with `detail` also per stage, and the pipeline walked through
    torch's orders where a rank's chunks differ."""
    stack, topology, ordered, first_ranks, owners = ranks.stack, ranks.topology, ranks.groups, ranks.first_ranks, \
        ranks.owners
    p, m_batches = layout.pp, layout.num_micro_batches
    # The slowest activation transfer between consecutive stages on different ranks.
    hop = max((p2p_time(ranks.activation_message, link) for link in ranks.hop_links), default=0.0)
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
        if not ddp_on_cpu(layout):
            dp_exposed += max(fsdp_host_time(layout, stack, g) for g in ordered)
        dp_exposed += bookkeeping_time(layout, topology, ranks.envs[0], [first_ranks[r] for r in range(p)])
    optimizer = max(optimizer_time(layout, g.env, g.dense, g.expert) + (optimizer_host_time(
        layout, g.env, parameter_tensors(layout.model, g.layers, g.first, g.last, g.first))
        if stack.eager_host_costs else 0.0) for g in ordered)
    step = pipe.total + dp_exposed + optimizer
    stages: list[StageCost] = []
    if detail:  # per-stage costs; where a rank's chunks differ, the pipeline walks torch's orders
        stages = _stage_list(layout, stack, ranks.envs, ranks.costs_of, owners, first_ranks, topology,
                             ranks.activation_message, ranks.embedding_activation, ranks.replica_shard,
                             ranks.expert_shard, ranks.sync.grads_sharded, ranks.unsharded_grad_bytes)
        held_by = {r: [h / w if w > 0 else 1.0 for h, w in zip(held_work, g.work)]
                   for g, held_work in zip(ordered, data.stretched) for r in g.ranks}
        walked, held_walked = walked_pipelines(
            pipe, held, layout.schedule, p, layout.virtual_stages, m_batches,
            [(s.forward, s.backward_input, s.backward_weight, s.send_activation) for s in stages], owners,
            [held_by[r] for r in owners], stack.async_p2p)
        dp_exposed += (held_walked - walked.total) - (held - pipe.total)
        pipe = walked
        step = pipe.total + dp_exposed + optimizer
    return _StepTime(pipe, data.total, dp_exposed, optimizer, step, stages)


def _memory(layout: Layout, ranks: _RankGroups, headroom: float) -> _Memory:
    """Every group's memory, the fullest rank's and whether all fit: a group peaks on its first rank (the
    one with the most micro-batches in flight)."""
    stack, p, m_batches = ranks.stack, layout.pp, layout.num_micro_batches
    e, tokens, sync, costs_of = ranks.element_bytes, ranks.tokens, ranks.sync, ranks.costs_of
    activation_message = ranks.activation_message
    copies = stack.loss_fp32_copies + (stack.loss_parallel_fp32_copies if layout.tp > 1 else 0)
    vocab = layout.model.vocab
    vocab_share = vocab if stack.tp_gathers_logits else padded_vocab(vocab, layout.tp) / layout.tp
    everywhere = layout.vocab_parallel and p > 1  # vocabulary parallelism: a vocab/pp slice on every rank
    if everywhere:
        vocab_share /= p
    logits = (4 * copies + e) * tokens * vocab_share
    if stack.pipeline_keeps_outputs and stack.pipeline_returns_outputs and p > 1:  # logits kept to be returned
        logits += (m_batches - 1) * kept_output_bytes(stack, e) * tokens * vocab_share
    # FSDP2 with torchao's FP8 all-gather gathers the block weights already cast: the unsharded weight FSDP2
    # holds is that FP8 tensor (fsdp_post_all_gather wraps the gathered bytes), 1 byte per element.
    fp8_gathered = layout.train.dtype == "fp8" and gathers_fp8_weights(stack) and layout.zero == 3
    gathered_bytes = 1 if fp8_gathered else e
    layer_params = sum(stage_params(layout, 1, False, False, vocab_rows=False))
    layer_weights = 2 * layer_params * gathered_bytes if layout.zero == 3 else 0.0  # this + next
    if layout.train.dtype == "fp8":  # the computing layer's FP8 weight copy (unless gathered so) and its transpose
        layer_weights += layer_params * (1 if fp8_gathered else 2)

    states: dict[int, list[float]] = {}

    def memory_parts(group: RankGroup, r: int) -> list[float]:
        if id(group) not in states:
            states[id(group)] = [a + b for a, b in zip(
                zero_model_state_bytes(group.dense, layout.train.dtype, layout.zero, ranks.replica_shard,
                                       sync.grads_sharded, ranks.unsharded_grad_bytes),
                zero_model_state_bytes(group.expert, layout.train.dtype, layout.zero, ranks.expert_shard,
                                       sync.grads_sharded, ranks.unsharded_grad_bytes))]
        parts = states[id(group)][:]
        chunks = in_flight_chunks(layout.schedule, p, layout.virtual_stages, m_batches, r)
        parts.append(chunks * group.activation / group.chunks)
        # ZeRO-3 holds the layers being gathered, or, kept gathered between passes, all of the rank's.
        gathered = layer_weights
        if sync.keeps_gathered:  # the blocks at gathered_bytes, the embedding, head and final norm in bf16
            blocks = sum(stage_params(layout, group.layers, False, False, vocab_rows=False))
            gathered = blocks * gathered_bytes + (group.dense + group.expert - blocks) * e
        working = costs_of[id(group.env)].transient + gathered + (logits if group.last or everywhere else 0.0)
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

    peak_group, peak_parts, peak_ratio, fits = ranks.groups[0], [], -1.0, True
    for group in ranks.groups:
        parts = memory_parts(group, group.ranks[0])
        usable = group.env.capacity * (1 - headroom)
        fits = fits and sum(parts) <= usable
        if sum(parts) / usable > peak_ratio:
            peak_group, peak_parts, peak_ratio = group, parts, sum(parts) / usable
    return _Memory(memory_parts, peak_group, peak_parts, peak_ratio, fits)


def kept_output_bytes(stack: SoftwareStack, element_bytes: int) -> int:
    """Bytes per logit of each micro-batch's last-stage output that torch.distributed.pipelining keeps until
    the step ends (its schedules merge the outputs to return them): the model's output dtype, fp32 where
    the model upcasts its logits (TorchTitan's Llama, `output = self.output(h).float()`), else the
    training dtype."""
    return 4 if stack.logits_fp32_output else element_bytes


def _stage_list(layout: Layout, stack: SoftwareStack, envs: list[RankEnv], costs_of: dict, owners: Sequence[int],
                first_ranks: list[int], topology: Topology, activation_message: float,
                embedding_activation: float, replica_shard: int, expert_shard: int,
                grads_sharded: bool, unsharded_grad_bytes: float = 0) -> list[StageCost]:
    """One StageCost per virtual stage, model order (identical stages are computed once)."""
    stages = []
    num_stages = len(owners)
    made: dict[tuple, dict] = {}
    # Vocabulary parallelism: each rank's slices of both ends, spread over its stages (cost/vocab.py).
    everywhere = layout.vocab_parallel and layout.pp > 1
    chunks_of = [list(owners).count(r) for r in range(layout.pp)] if everywhere else []
    first_of_rank = {r: list(owners).index(r) for r in range(layout.pp)} if everywhere else {}
    for index, layers in enumerate(layout.layers_per_stage):
        r = owners[index]
        first, last = index == 0, index == num_stages - 1
        target = None if last or owners[index + 1] == r else first_ranks[owners[index + 1]]
        source = first_ranks[r]
        hop_key = None if target is None else (topology.node_of[source] == topology.node_of[target],
                                               topology.group_of[source], topology.group_of[target])
        key = (layers, first, last, id(envs[r]), r == owners[0], hop_key,
               (chunks_of[r], first_of_rank[r] == index) if everywhere else None)
        fields = made.get(key)
        if fields is None:
            layer, embedding, head, activation, _, per_chunk = costs_of[id(envs[r])]
            cost = layer.scaled(layers) + per_chunk
            if not first:
                cost = cost + split_backward_host(layout, envs[r], stack, layers, 1)
            if everywhere:
                cost = cost + (embedding + head).scaled(1 / chunks_of[r])
            else:
                if first:
                    cost = cost + embedding
                if last:
                    cost = cost + head
            send = 0.0 if target is None else p2p_time(activation_message, topology.pair_link(source, target))
            dense, expert = stage_params(layout, layers, first, last, holds_embedding=r == owners[0],
                                         vocab_rows=not everywhere or first_of_rank[r] == index)
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


