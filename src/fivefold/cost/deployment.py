"""Where a serving deployment's devices sit and what each replica holds: placement, KV capacity, memory.

Placement: replica r takes the devices [r * tp * pp, (r + 1) * tp * pp) in the cluster's order, stage s of it the
tp devices after s * tp of those; so a tp group stays inside a node when tp divides the node, pp crosses nodes
(or groups of a mixed cluster) before tp does, and replicas fill the fast groups first as the cluster lists them.
A replica that spans two kinds of device runs at the slower one's pace (a step waits for every rank).

KV capacity (vLLM's rule): what is left of `memory_utilization` x device memory after the weights and the
activation workspace of a step, cut into blocks (spec/serve.kv_blocks_for_memory). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.cost.comm import SELF, GroupLink, topology_of
from fivefold.cost.serving import ReplicaCost
from fivefold.errors import SpecError
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.serve import BatchLimits, ServeLayout, kv_bytes_per_token
from fivefold.spec.units import GIB

MEMORY_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization default: the share of device memory the engine takes
WORKSPACE_BYTES = 1.0 * GIB  # CUDA context, cuBLAS workspace, CUDA graphs' pools (vLLM reserves about this)


@dataclass
class Replica:
    """One copy of the model: its devices by stage and its step-time model."""

    devices: tuple[tuple[int, ...], ...]  # per stage, the tp devices
    cost: ReplicaCost
    kv_blocks: int
    memory_bytes: float  # busiest device: weights + KV + workspace

    @property
    def label(self) -> str:
        return self.cost.device_spec.name


def _slowest(cluster: ClusterSpec, devices: list[int]):
    group_of = topology_of(cluster).group_of
    groups = [cluster.groups[group_of[d]] for d in devices]
    slowest = min(groups, key=lambda g: (g.device.memory_bandwidth, g.device.peak_flops.get("bf16", 0.0),
                                         g.device.memory_bytes))
    return slowest.device, slowest.calibration


def _links(cluster: ClusterSpec, stages: list[tuple[int, ...]]) -> tuple[GroupLink, GroupLink]:
    """The slowest tp group and the slowest stage boundary of one replica."""
    topology = topology_of(cluster)
    tp_link = max((topology.group_link(s) for s in stages), key=lambda link: (link.latency, -link.ring_bandwidth))
    pp_link = SELF
    for a, b in zip(stages, stages[1:]):
        link = topology.pair_link(a[0], b[0])
        if pp_link is SELF or link.network_bandwidth < pp_link.network_bandwidth or link.latency > pp_link.latency:
            pp_link = link
    return tp_link, pp_link


def place(model: ModelSpec, cluster: ClusterSpec, layout: ServeLayout, kv_blocks: int | None = None,
          kv_memory_gib: float | None = None) -> list[Replica]:
    """The replicas of `layout` on `cluster`: devices, cost model, KV blocks (given, from --kv-memory, or what
    memory leaves) and memory per device. Errors name the flag to change."""
    layout.check_model(model)
    world = cluster.world_size
    if layout.devices > world:
        raise SpecError("--replicas", layout.replicas, f"tp x pp x replicas = {layout.devices} devices; the cluster "
                        f"has {world}")
    replicas = []
    costs: dict[tuple, ReplicaCost] = {}
    width = layout.tp * layout.pp
    for r in range(layout.replicas):
        base = r * width
        stages = [tuple(range(base + s * layout.tp, base + (s + 1) * layout.tp)) for s in range(layout.pp)]
        spec, calibration = _slowest(cluster, list(range(base, base + width)))
        if layout.dtype == "fp8" and "fp8" not in spec.peak_flops:
            raise SpecError("--dtype", "fp8", f"{spec.name} has no FP8 tensor cores; serve in bf16")
        tp_link, pp_link = _links(cluster, stages)
        key = (id(spec), id(calibration), tp_link, pp_link)
        cost = costs.get(key)
        if cost is None:  # replicas on the same kind of devices and links share one model (and its caches)
            cost = costs[key] = ReplicaCost(model, spec, layout.tp, layout.pp, layout.dtype, layout.kv_dtype,
                                            layout.ep, tp_link, pp_link, calibration=calibration,
                                            on_workers=layout.devices > 1)
        per_token = kv_bytes_per_token(model, layout.tp, layout.pp, layout.kv_dtype)
        block_bytes = per_token * layout.limits.block_size
        if kv_blocks is not None:
            blocks = kv_blocks
        else:
            budget = (kv_memory_gib * GIB if kv_memory_gib is not None else
                      spec.memory_bytes * MEMORY_UTILIZATION - cost.weight_bytes - WORKSPACE_BYTES)
            blocks = int(budget // block_bytes)
            if blocks < 1:
                need = (cost.weight_bytes + WORKSPACE_BYTES) / GIB
                raise SpecError("--tp", layout.tp, f"{model.name} leaves no room for a KV cache on {spec.name} "
                                f"({need:.1f} GiB of weights and workspace on a device of "
                                f"{spec.memory_bytes / GIB:.0f} GiB); use more tp or pp")
        memory = cost.weight_bytes + WORKSPACE_BYTES + blocks * block_bytes
        replicas.append(Replica(tuple(stages), cost, blocks, memory))
    return replicas


def limits_with_blocks(limits: BatchLimits, blocks: int) -> BatchLimits:
    """The scheduler limits of one replica with its KV blocks."""
    return BatchLimits(limits.max_batch, limits.max_tokens_per_step, blocks, limits.block_size)
