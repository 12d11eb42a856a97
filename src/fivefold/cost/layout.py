"""Layout: a Plan's fields without validation, and what each pipeline rank runs on.

The planner enumerates thousands of layouts a second; building and validating a Plan for each would cost
more than costing it, so it builds Layouts, which share Plan's rank arithmetic (spec.plan.MeshRanks)
and so agree with the Plan the winner becomes. For every pipeline rank we find its device (the slowest
among the devices its ranks sit on; with uneven micro-batches per replica, among those of the replica that
finishes last, whose count is then num_micro_batches) and the links of its TP, CP, EP and data-parallel
groups through the placement; per-layer costs are cached on everything they depend on.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Iterable, NamedTuple

from fivefold.cost.cache import IdentityCache
from fivefold.cost.comm import SELF, GroupLink, Topology, all_reduce_time, topology_of
from fivefold.cost.compute import Device
from fivefold.cost.layer import ZERO_PASS, LayerShape, PassCost, embedding_cost, head_cost, layer_cost, padded_vocab
from fivefold.cost.memory import layer_activation_bytes, layer_transient_bytes
from fivefold.cost.moe import expert_param_share
from fivefold.cost.stack import SoftwareStack
from fivefold.cost.vocab import comm_pass, pp_group_link, vocab_parallel_comm, vocab_share
from fivefold.spec.plan import MeshRanks, Plan, stage_owners  # noqa: F401 - stage_owners: the cost model's import point

if TYPE_CHECKING:
    from fivefold.spec.cluster import ClusterSpec
    from fivefold.spec.model import ModelSpec
    from fivefold.spec.train import TrainSpec


class Layout(MeshRanks):
    """A Plan's fields without validation or an explicit placement: what the planner enumerates.

    The rank arithmetic is Plan's own (both are spec.plan.MeshRanks), so both agree by construction.
    """

    __slots__ = ("model", "cluster", "train", "dp", "tp", "pp", "cp", "cp_method", "ep", "etp", "zero", "micro_batch",
                 "schedule", "virtual_stages", "layers_per_stage", "recompute", "sequence_parallel",
                 "placement", "num_micro_batches", "replica_micro_batches", "vocab_parallel")
    if TYPE_CHECKING:  # the slots' types (Plan's fields of the same names)
        model: ModelSpec
        cluster: ClusterSpec
        train: TrainSpec
        dp: int
        tp: int
        pp: int
        cp: int
        cp_method: str
        ep: int
        etp: int
        zero: int
        micro_batch: int
        schedule: str
        virtual_stages: int
        layers_per_stage: tuple[int, ...]
        recompute: str
        sequence_parallel: bool
        placement: tuple[int, ...]  # () = the identity
        num_micro_batches: int
        replica_micro_batches: tuple[int, ...]
        vocab_parallel: bool


    def __init__(self, **fields: object) -> None:
        for name in self.__slots__:
            setattr(self, name, fields.get(name, False) if name == "vocab_parallel" else fields[name])

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @classmethod
    def of_plan(cls, plan: Plan) -> Layout:
        identity = plan.placement == tuple(range(plan.world_size))
        layout = cls(**{name: getattr(plan, name) for name in cls.__slots__ if name != "placement"},
                     placement=() if identity else plan.placement)
        if plan.replica_micro_batches:
            layout.num_micro_batches = plan.replica_micro_batches[pacing_replica(layout)]
        return layout


def pacing_replica(layout: Layout) -> int:
    """With uneven micro-batches per replica, the replica that finishes last and so sets the step's pace:
    the most micro-batches per FLOP/s of its slowest device. The estimate costs that replica's pipeline."""
    topology, dtype = topology_of(layout.cluster), layout.train.dtype
    speed_of = [g.device.flops(dtype) for g in layout.cluster.groups]

    def slowest(dp: int) -> float:
        return min(speed_of[topology.group_of[_device_index(layout, r)]] for r in layout.replica_ranks(dp))
    return max(range(layout.dp), key=lambda dp: (layout.replica_micro_batches[dp] / slowest(dp), -dp))


class LayerCosts(NamedTuple):
    """What one micro-batch costs on one pipeline rank, per piece of the model (cost/layer.py's PassCosts)."""

    layer: PassCost  # one transformer layer
    embedding: PassCost
    head: PassCost  # final norm, LM head and loss
    activation: float  # bytes one layer stores per in-flight micro-batch
    transient: float  # working bytes of one layer's passes
    per_chunk: PassCost = ZERO_PASS  # once per stage model on the rank (an eager runtime's host costs)


_LAYER_CACHE: IdentityCache[LayerCosts] = IdentityCache(20000)  # keyed by value (owner None)


class RankEnv:
    """Device and links of one pipeline rank."""

    __slots__ = ("device", "capacity", "tp", "cp", "ep", "replicas", "expert_replicas", "etp")

    def __init__(self, device: Device, capacity: float, tp: GroupLink, cp: GroupLink, ep: GroupLink,
                 replicas: GroupLink, expert_replicas: GroupLink, etp: GroupLink = SELF) -> None:
        self.device, self.capacity = device, capacity
        self.tp, self.cp, self.ep, self.replicas, self.expert_replicas = tp, cp, ep, replicas, expert_replicas
        self.etp = etp  # the expert tensor-parallel group (MoE parallel folding; SELF when etp = 1)


def _device_index(layout: Layout, rank: int) -> int:
    return layout.placement[rank] if layout.placement else rank


_ENV_CACHE: IdentityCache[list[RankEnv]] = IdentityCache(4096)


def rank_envs(layout: Layout, topology: Topology) -> list[RankEnv]:
    """Device and links of every pipeline rank (cached: the planner asks for each placement many times)."""
    key = (layout.train.dtype, layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.etp,
           layout.placement, layout.replica_micro_batches)
    cached = _ENV_CACHE.get(topology, key)
    if isinstance(cached, list):
        return cached
    return _ENV_CACHE.put(topology, key, _build_rank_envs(layout, topology))


def _congruent(stride: int, members: int, per_node: int) -> bool:
    """Whether every group of `members` ranks `stride` apart, starting anywhere a group of the mesh starts,
    sits on the nodes the same way (so the first group stands for all): each member on its own node, the
    whole group inside one node, or whole nodes of members."""
    span = stride * members
    return stride % per_node == 0 or per_node % span == 0 or (per_node % stride == 0 and span % per_node == 0)


GROUPS_CHECKED = 512  # at most this many groups of one dimension are looked at per pipeline rank


def _slowest(links: list[GroupLink]) -> GroupLink:
    """The group whose collectives take longest (a 64 MiB all-reduce as the yardstick): it sets the pace."""
    return max(links, key=lambda link: (all_reduce_time(2.0**26, link), link.size))


def _build_rank_envs(layout: Layout, topology: Topology) -> list[RankEnv]:
    cluster, dtype = layout.cluster, layout.train.dtype
    homogeneous = cluster.is_homogeneous and not layout.placement
    per_node = cluster.groups[0].gpus_per_node
    block_size = layout.dp * layout.cp * layout.tp
    # Every pp rank's block lies on the nodes the same way when blocks are whole nodes or fit in one.
    same_blocks = homogeneous and (block_size % per_node == 0 or per_node % block_size == 0)
    envs: list[RankEnv] = []
    devices: dict[int, Device] = {}
    pace = pacing_replica(layout) if layout.replica_micro_batches and not homogeneous else None
    for pp_rank in range(layout.pp):
        if same_blocks and envs:
            envs.append(envs[0])
            continue
        block = layout.pipeline_ranks(pp_rank)
        # (one device group: no need to look up every rank of the block)
        groups = {0} if len(cluster.groups) == 1 else {topology.group_of[_device_index(layout, r)] for r in block}
        paced = groups if pace is None else {topology.group_of[_device_index(layout, layout.rank_of(
            pp=pp_rank, dp=pace, cp=c, tp=t))] for c in range(layout.cp) for t in range(layout.tp)}
        slowest = min(paced, key=lambda g: (cluster.groups[g].device.flops(dtype), g))
        if slowest not in devices:
            devices[slowest] = Device(cluster.groups[slowest].device, dtype, cluster.groups[slowest].calibration)
        capacity = min(cluster.groups[g].device.memory_bytes for g in groups)

        def link(ranks: list[int]) -> GroupLink:
            return topology.group_link([_device_index(layout, r) for r in ranks])

        def links_of(stride: int, members: int, starts: Iterable[int]) -> GroupLink:
            """The slowest of the groups of `members` ranks `stride` apart that start at `starts`: every group
            of a dimension is costed on the links its ranks use (a tp6 group across two 8-GPU nodes
            talks over the NIC although the first tp6 group sits inside one node). `starts` is consumed
            lazily: most groups need only their first start."""
            if members <= 1:
                return SELF
            looked_at = 1 if homogeneous and _congruent(stride, members, per_node) else GROUPS_CHECKED
            return _slowest([link([start + i * stride for i in range(members)])
                             for start in itertools.islice(starts, looked_at)])

        tp, cp, ep = layout.tp, layout.cp, layout.ep
        # the first rank of every tp group of this pipeline rank, one per (dp, cp) replica in (dp, cp) order:
        # tp is the innermost mesh dim, so every tp-th rank of the block
        replicas = block[::tp]
        tp_link = links_of(1, tp, replicas)
        cp_link = links_of(tp, cp, (layout.rank_of(pp=pp_rank, dp=i, tp=t) for i in range(layout.dp)
                                    for t in range(tp)))
        replica_links = [link([r + t for r in replicas]) for t in range(
            1 if homogeneous and _congruent(tp, len(replicas), per_node) else min(tp, GROUPS_CHECKED))]
        replica_link = _slowest(replica_links)
        expert_link, expert_replicas, etp_link = SELF, replica_link, SELF
        inner = layout.etp
        if layout.model.is_moe and (ep > 1 or inner != tp):
            # Stage ranks s = (dp * cp + c) * tp + t (the block's order) regroup as edp x ep x etp (etp
            # innermost, spec/folding.py): an ep group is ep ranks etp apart, an edp group edp ranks etp * ep apart.
            edp = len(block) // (ep * inner)
            offsets = range(1 if homogeneous and _congruent(inner, ep, per_node) else min(inner, GROUPS_CHECKED))
            expert_link = _slowest([link([block[o + i * inner] for i in range(ep)]) for o in offsets])
            offsets = range(min(inner * ep, GROUPS_CHECKED))
            expert_replicas = _slowest([link([block[o + j * inner * ep] for j in range(edp)]) for o in offsets])
        if layout.etp > 1:
            etp_link = links_of(1, layout.etp, block[::layout.etp])
        envs.append(RankEnv(devices[slowest], capacity, tp_link, cp_link, expert_link, replica_link, expert_replicas,
                            etp_link))
    return envs


_LAYER_COSTS_OF_ENV: IdentityCache[LayerCosts] = IdentityCache(20000)  # the same, by rank env: a cheaper key


def layer_costs(layout: Layout, env: RankEnv, stack: SoftwareStack) -> LayerCosts:
    """The PassCosts and bytes of one layer, the embedding and the head on a rank like `env`, cached."""
    train = layout.train
    key = (layout.model, train.seq_len, layout.micro_batch, layout.tp, layout.cp, layout.ep, layout.etp,
           layout.sequence_parallel,
           layout.recompute, train.expert_imbalance, train.expert_load, layout.cp_method, stack,
           *((layout.pp, layout.dp, layout.placement) if layout.vocab_parallel else ()))
    cached = _LAYER_COSTS_OF_ENV.get(env, key)
    if isinstance(cached, LayerCosts):
        return cached
    return _LAYER_COSTS_OF_ENV.put(env, key, _layer_costs(layout, env, stack))


def _layer_costs(layout: Layout, env: RankEnv, stack: SoftwareStack) -> LayerCosts:
    """layer_costs, cached on the values the costs depend on (ranks on equal devices and links share them)."""
    shape = LayerShape(layout.model, layout.train.seq_len, layout.micro_batch, layout.tp, layout.cp, layout.ep,
                       layout.sequence_parallel, layout.recompute, layout.train.expert_imbalance,
                       cp_method=layout.cp_method, etp=layout.etp, expert_load=layout.train.expert_load)
    device = env.device
    split = vocab_share(layout.pp, layout.vocab_parallel)
    pp_link = pp_group_link(layout, topology_of(layout.cluster)) if split > 1 else SELF
    key = (shape, device.spec.name, device.peak, device.fp8_gemm_peak, device.bandwidth, device.element_bytes,
           device.gemm_curve, stack,
           env.tp, env.cp, env.ep, env.etp, split, pp_link)
    cached = _LAYER_CACHE.get(None, key)
    if isinstance(cached, LayerCosts):
        return cached
    dropout = stack.uses_dropout(layout.model)
    head = head_cost(shape, device, stack, env.tp, split)
    if split > 1:  # vocabulary parallelism: every pp rank's slice, and its collectives over the pp group
        head = head + comm_pass(vocab_parallel_comm(layout, pp_link, device.element_bytes))
    return _LAYER_CACHE.put(None, key, LayerCosts(
        layer_cost(shape, device, stack, env.tp, env.cp, env.ep, env.etp), embedding_cost(shape, device, stack, env.tp),
        head,
        layer_activation_bytes(shape, dropout, stack.attention, device.element_bytes, stack.selective_saves_ops,
                               stack.selective_saves_every_matmul, stack.cp_repeats_kv, stack.cp_ring_backward),
        layer_transient_bytes(shape, dropout, stack.attention, device.element_bytes, stack.cp_repeats_kv,
                              stack.cp_ring_backward)))


def layer_work(layout: Layout, stack: SoftwareStack) -> tuple[PassCost, PassCost, PassCost]:
    """(one layer, embedding, LM head) costs for one micro-batch on pipeline rank 0 (the planner's bounds)."""
    env = rank_envs(layout, topology_of(layout.cluster))[0]
    costs = layer_costs(layout, env, stack)
    return costs.layer, costs.embedding, costs.head


_STAGE_PARAMS: IdentityCache[tuple[float, float]] = IdentityCache(20000)  # by model: the planner asks ~10^4 times


def stage_params(layout: Layout, layers: int, first: bool, last: bool,
                 holds_embedding: bool = False, vocab_rows: bool = True) -> tuple[float, float]:
    """(dense, expert) parameters one TP rank of a stage holds.

    `holds_embedding`: the rank running this (last) stage also runs the first one (zbv puts both ends on
    rank 0), so a tied LM head can use the embedding matrix itself instead of a copy. Under vocabulary
    parallelism every rank holds its vocabulary rows once: `vocab_rows` False for its other stages."""
    split = vocab_share(layout.pp, layout.vocab_parallel)
    split = -1 if split > 1 and not vocab_rows else split  # -1: vocabulary parallel, rows held by another stage
    key = (layout.tp, layout.ep, layout.etp, layers, first, last, holds_embedding, split)
    cached = _STAGE_PARAMS.get(layout.model, key)
    if isinstance(cached, tuple):
        return cached
    return _STAGE_PARAMS.put(layout.model, key, _stage_params(layout, layers, first, last, holds_embedding, split))


def _stage_params(layout: Layout, layers: int, first: bool, last: bool, holds_embedding: bool,
                  split: int = 1) -> tuple[float, float]:
    m, t = layout.model, layout.tp
    per_layer: float = m.params_per_layer()
    expert = 0.0
    if m.is_moe:
        per_layer, all_experts = expert_param_share(m)  # an average layer (cost/moe.py)
        expert = layers * all_experts / (layout.ep * layout.etp)  # experts over ep, each split over etp
    dense = layers * per_layer / t
    vocab_rows = padded_vocab(m.vocab, t) * m.hidden / t
    if split > 1 or split < 0:  # vocabulary parallelism: every rank holds its rows of both ends (once if tied)
        if split > 1:
            rows = padded_vocab(m.vocab, t * split) * m.hidden / (t * split)
            dense += rows * (1 if m.tied_embeddings else 2)
        if first and m.position == "learned":
            dense += m.max_seq_len * m.hidden
        if last:
            dense += m.hidden if m.norm == "rmsnorm" else 2 * m.hidden
        return dense, expert
    if first:
        dense += vocab_rows + (m.max_seq_len * m.hidden if m.position == "learned" else 0)
    if last:
        # An untied head has its own matrix; a tied one needs a copy when the embedding is elsewhere.
        if not m.tied_embeddings or not (first or holds_embedding):
            dense += vocab_rows
        dense += m.hidden if m.norm == "rmsnorm" else 2 * m.hidden
    return dense, expert


class GroupWork(NamedTuple):
    """What a pipeline rank's layers, ends of the model and stage models cost for one micro-batch."""

    cost: PassCost
    work: tuple[float, float, float]  # (F, B with recompute, W)
    dense: float  # parameters, as stage_params
    expert: float
    activation: float  # bytes stored per in-flight micro-batch


# Keyed by the LayerCosts object: the planner builds the same groups for every ZeRO level of a split.
_GROUP_WORK: IdentityCache[GroupWork] = IdentityCache(20000)


def group_work(layout: Layout, costs: LayerCosts, layers: int, first: bool, last: bool, chunks: int,
               extra_activation: float, extra: PassCost = ZERO_PASS) -> GroupWork:
    """The GroupWork of a rank with `layers` layers in `chunks` stage models, plus `extra` (cached)."""
    key = (layout.model, layout.tp, layout.ep, layout.etp, layers, first, last, chunks, extra_activation, extra,
           layout.vocab_parallel and layout.pp)
    cached = _GROUP_WORK.get(costs, key)
    if isinstance(cached, GroupWork):
        return cached
    layer, embedding, head, activation, _, per_chunk = costs
    # One pass over the fields (a miss here is the search's most frequent new cost): layers x layer +
    # chunks x per-chunk + the ends the rank holds + extra.
    # Added in the order of the field-wise sums it replaces, so every float is the same.
    everywhere = layout.vocab_parallel and layout.pp > 1  # vocabulary parallelism: both ends' slices on every rank
    ends = [part for part, held in ((extra, extra is not ZERO_PASS), (embedding, first or everywhere),
                                    (head, last or everywhere)) if held]
    values = [a * layers + b * chunks for a, b in zip(layer, per_chunk)]
    for end in ends:
        values = [value + x for value, x in zip(values, end)]
    cost = PassCost._make(values)
    # Stage params are linear in layers, so the rank's sum is one call with its totals.
    dense, expert = stage_params(layout, layers, first, last, holds_embedding=first)
    return _GROUP_WORK.put(costs, key, GroupWork(
        cost, (cost.forward, cost.backward_input + cost.recompute, cost.backward_weight), dense, expert,
        layers * activation + (extra_activation if first else 0.0)))


class RankGroup:
    """Pipeline ranks that do identical work: same layers, same ends of the model, same device."""

    __slots__ = ("ranks", "env", "layers", "first", "last", "chunks", "cost", "work", "dense", "expert",
                 "activation")

    def __init__(self, layout: Layout, stack: SoftwareStack, env: RankEnv, costs: LayerCosts, layers: int,
                 first: bool, last: bool, chunks: int, extra_activation: float, extra: PassCost = ZERO_PASS
                 ) -> None:
        self.ranks: list[int] = []  # shared with the cached pipeline shape: never mutate
        self.env, self.layers, self.first, self.last, self.chunks = env, layers, first, last, chunks
        self.cost, self.work, self.dense, self.expert, self.activation = group_work(
            layout, costs, layers, first, last, chunks, extra_activation, extra)
