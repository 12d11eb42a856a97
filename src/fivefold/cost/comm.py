"""Communication time: alpha-beta costs of collectives over the links the placement puts a group on.

Collective costs (Thakur, Rabenseifner & Gropp 2005; Chan et al. 2007), for n ranks, S bytes, a per-step
latency alpha and a per-rank bus bandwidth beta:
    ring all-reduce        2 (n-1) alpha + 2 (n-1)/n * S / beta
    tree all-reduce        2 log2(n) alpha + 2 S / beta          (NCCL double binary tree; wins when small)
    all-gather / reduce-scatter   (n-1) alpha + (n-1)/n * S / beta   (S = the full, unsharded size)
    all-to-all             (n-1) alpha + the slower of the bytes that stay on the node and those that leave
    point-to-point         alpha + S / beta

Measured curves: a cluster group profiled by `fivefold profile` carries collective times per
(collective, ranks, message size) measured inside one of its nodes. A group of that size inside one such
node takes its time from them instead: piecewise-linear interpolation of log time over log message size,
and beyond the measured sizes the alpha-beta line through the first and last measured points (latency of
the smallest message, bandwidth of the largest). Group sizes that were not measured, and groups that
span nodes, keep the alpha-beta formulas above.

Which bandwidth a group gets follows the placement. A group inside one node rides NVLink (or xGMI/PCIe).
A group spanning nodes crosses the network, and a node's NIC is shared by everything on that node that
talks at the same time: the collectives of a training step run in lockstep, so every GPU of the node is
in some group of the same kind, and a group with k members on a node gets k / gpus_per_node of that
node's NIC bandwidth (NCCL builds one ring per NIC, so k members use k NICs' worth). The slowest node of
the group sets the ring speed. NCCL reaches about 80% of NVLink and 90% of InfiniBand line rate for large
messages (nccl-tests bus bandwidth on DGX A100/H100), hence the efficiency factors.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

from fivefold.cost.cache import IdentityCache
from fivefold.spec.cluster import Calibration, ClusterSpec

INTRA_EFFICIENCY = 0.8  # NCCL bus bandwidth / NVLink datasheet bandwidth
NETWORK_EFFICIENCY = 0.9  # NCCL bus bandwidth / NIC line rate


class MeasuredCollectives:
    """Collective times one `fivefold profile` measured inside a node, looked up by message size.

    Message sizes follow the profile's convention (profile/collectives.py): the tensor for all-reduce and
    reduce-scatter (its input), each rank's shard for all-gather, each rank's send buffer for all-to-all,
    the message for send/recv (measured between two ranks, whatever the process count)."""

    def __init__(self, calibration: Calibration) -> None:
        points: dict[tuple[str, int], dict[int, float]] = {}
        for collective, ranks, message_bytes, seconds in calibration.collectives:
            if message_bytes > 0 and seconds > 0:
                key = (collective, 2 if collective == "send_recv" else ranks)
                points.setdefault(key, {})[message_bytes] = seconds
        # Per (collective, ranks): log sizes, log times, and the alpha-beta line through the end points.
        self.curves: dict[tuple[str, int], tuple[list[float], list[float], float, float]] = {}
        for key, by_size in points.items():
            if len(by_size) < 2:
                continue  # one size gives no curve; the formulas stay
            sizes = sorted(by_size)
            small, large = sizes[0], sizes[-1]
            bandwidth = (large - small) / max(by_size[large] - by_size[small], 1e-12)
            latency = max(0.0, by_size[small] - small / bandwidth)
            self.curves[key] = ([math.log(b) for b in sizes], [math.log(by_size[b]) for b in sizes],
                                latency, bandwidth)

    def seconds(self, collective: str, ranks: int, message_bytes: float) -> float | None:
        """Measured time of one call, or None when this collective at this group size was not measured."""
        curve = self.curves.get((collective, ranks))
        if curve is None:
            return None
        sizes, times, latency, bandwidth = curve
        if message_bytes <= 0:
            return 0.0
        x = math.log(message_bytes)
        if x < sizes[0] or x > sizes[-1]:
            return latency + message_bytes / bandwidth
        i = min(bisect_right(sizes, x), len(sizes) - 1)
        share = (x - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return math.exp(times[i - 1] + share * (times[i] - times[i - 1]))


_MEASURED: IdentityCache[MeasuredCollectives] = IdentityCache(64)


def measured_collectives(calibration: Calibration | None) -> MeasuredCollectives | None:
    """The lookup object of a calibration (cached: the planner asks for the same one many times)."""
    if calibration is None or not calibration.collectives:
        return None
    cached = _MEASURED.get(calibration)
    if isinstance(cached, MeasuredCollectives):
        return cached
    return _MEASURED.put(calibration, None, MeasuredCollectives(calibration))


@dataclass(frozen=True)
class GroupLink:
    """The links one communicating group sits on (one rank's view; all ranks of the group agree)."""

    size: int  # ranks in the group
    nodes: int  # nodes the group spans
    members_per_node: int  # fewest members the group has on one of its nodes
    intra_bandwidth: float  # achievable bytes/s per GPU inside a node
    network_bandwidth: float  # achievable bytes/s of one GPU's NIC share (node NIC / gpus per node)
    latency: float  # seconds per step of a collective
    measured: MeasuredCollectives | None = None  # the node's profiled curves (groups inside one node only)

    @property
    def ring_bandwidth(self) -> float:
        """Bus bandwidth of a ring over this group: NVLink inside a node, the group's NIC share across."""
        if self.nodes <= 1:
            return self.intra_bandwidth
        across = self.network_bandwidth * self.members_per_node
        return min(across, self.intra_bandwidth) if self.members_per_node > 1 else across


SELF = GroupLink(1, 1, 1, float("inf"), float("inf"), 0.0)


class Topology:
    """Where every device of a cluster sits, for fast group lookups (built once per cluster)."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.node_of: list[int] = []
        self.group_of: list[int] = []
        self.node_group: list[int] = []
        for group_index, group in enumerate(cluster.groups):
            for _ in range(group.nodes):
                node = len(self.node_group)
                self.node_group.append(group_index)
                self.node_of.extend([node] * group.gpus_per_node)
                self.group_of.extend([group_index] * group.gpus_per_node)

    def group_link(self, devices: list[int] | tuple[int, ...]) -> GroupLink:
        """The link a collective over these device indices runs on."""
        n = len(devices)
        if n <= 1:
            return SELF
        per_node: dict[int, int] = {}
        for device in devices:
            node = self.node_of[device]
            per_node[node] = per_node.get(node, 0) + 1
        groups = [self.cluster.groups[self.node_group[node]] for node in per_node]
        intra = min(g.intra_node_bandwidth for g in groups) * INTRA_EFFICIENCY
        if len(per_node) == 1:
            return GroupLink(n, 1, n, intra, float("inf"), groups[0].intra_node_latency,
                             measured_collectives(groups[0].calibration))
        # Each GPU's share of its node's NIC; the slowest node and the fewest members set the ring speed.
        spans_groups = len({self.node_group[node] for node in per_node}) > 1
        per_gpu = float("inf")
        for node in per_node:
            group = self.cluster.groups[self.node_group[node]]
            nic = group.network_bandwidth
            if spans_groups and self.cluster.between_groups_bandwidth:
                nic = self.cluster.between_groups_bandwidth
            per_gpu = min(per_gpu, nic / group.gpus_per_node)
        latency = max(g.network_latency for g in groups)
        if spans_groups and self.cluster.between_groups_latency:
            latency = self.cluster.between_groups_latency
        return GroupLink(n, len(per_node), min(per_node.values()), intra, per_gpu * NETWORK_EFFICIENCY, latency)

    def pair_link(self, a: int, b: int) -> GroupLink:
        """Point-to-point between two devices; across nodes every GPU of the node sends at once."""
        if a == b:
            return SELF
        ga = self.cluster.groups[self.group_of[a]]
        gb = self.cluster.groups[self.group_of[b]]
        intra = ga.intra_node_bandwidth * INTRA_EFFICIENCY
        if self.node_of[a] == self.node_of[b]:
            return GroupLink(2, 1, 2, intra, float("inf"), ga.intra_node_latency, measured_collectives(ga.calibration))
        # Same rule as ClusterSpec.link: the slower NIC, or the between-groups link when one is given.
        nic = min(ga.network_bandwidth, gb.network_bandwidth)
        latency = max(ga.network_latency, gb.network_latency)
        if self.group_of[a] != self.group_of[b]:
            nic = self.cluster.between_groups_bandwidth or nic
            latency = self.cluster.between_groups_latency or latency
        share = nic / max(ga.gpus_per_node, gb.gpus_per_node) * NETWORK_EFFICIENCY
        return GroupLink(2, 2, 1, intra, share, latency)


_TOPOLOGIES: IdentityCache[Topology] = IdentityCache(32)


def topology_of(cluster: ClusterSpec) -> Topology:
    """The Topology of a cluster, cached (the planner asks for the same cluster many times)."""
    cached = _TOPOLOGIES.get(cluster)
    if isinstance(cached, Topology):
        return cached
    return _TOPOLOGIES.put(cluster, None, Topology(cluster))


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


def _measured(link: GroupLink, collective: str, message_bytes: float) -> float | None:
    return link.measured.seconds(collective, link.size, message_bytes) if link.measured is not None else None


def all_reduce_time(num_bytes: float, link: GroupLink) -> float:
    """The faster of ring and double-binary-tree all-reduce (or the measured curve)."""
    n = link.size
    if n <= 1 or num_bytes <= 0:
        return 0.0
    measured = _measured(link, "all_reduce", num_bytes)
    if measured is not None:
        return measured
    beta = link.ring_bandwidth
    ring = 2 * (n - 1) * link.latency + 2 * (n - 1) / n * num_bytes / beta
    tree = 2 * _log2_ceil(n) * link.latency + 2 * num_bytes / beta
    return min(ring, tree)


def all_gather_time(num_bytes: float, link: GroupLink) -> float:
    """All-gather of a tensor whose full (gathered) size is `num_bytes`."""
    n = link.size
    if n <= 1 or num_bytes <= 0:
        return 0.0
    measured = _measured(link, "all_gather", num_bytes / n)  # the profile names each rank's shard
    if measured is not None:
        return measured
    return (n - 1) * link.latency + (n - 1) / n * num_bytes / link.ring_bandwidth


def reduce_scatter_time(num_bytes: float, link: GroupLink) -> float:
    """Reduce-scatter of a tensor whose full (input) size is `num_bytes`: the ring cost of an all-gather."""
    n = link.size
    if n <= 1 or num_bytes <= 0:
        return 0.0
    measured = _measured(link, "reduce_scatter", num_bytes)
    if measured is not None:
        return measured
    return (n - 1) * link.latency + (n - 1) / n * num_bytes / link.ring_bandwidth


def all_to_all_time(bytes_per_rank: float, link: GroupLink) -> float:
    """All-to-all where each rank sends `bytes_per_rank` in total, spread evenly over the group."""
    n = link.size
    if n <= 1 or bytes_per_rank <= 0:
        return 0.0
    measured = _measured(link, "all_to_all", bytes_per_rank)
    if measured is not None:
        return measured
    k = link.members_per_node
    inside = (k - 1) / n * bytes_per_rank / link.intra_bandwidth
    outside = (n - k) / n * bytes_per_rank / link.network_bandwidth if link.nodes > 1 else 0.0
    return (n - 1) * link.latency + max(inside, outside)


def p2p_time(num_bytes: float, link: GroupLink) -> float:
    if link.size <= 1 or num_bytes <= 0:
        return 0.0
    measured = _measured(link, "send_recv", num_bytes)
    if measured is not None:
        return measured
    bandwidth = link.intra_bandwidth if link.nodes <= 1 else link.network_bandwidth
    return link.latency + num_bytes / bandwidth
