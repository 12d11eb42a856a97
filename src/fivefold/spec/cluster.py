"""ClusterSpec: groups of identical nodes, the links inside and between them.

Shorthand: `NODESxGPUSxDEVICE[:key=value,...]`, groups joined with `+`, e.g.
`2x8xA100-80GB+2x8xH100-SXM:nic=400Gb/s`. `GPUSxDEVICE` means one node.
Keys: nvlink (per-GPU intra-node bandwidth, one direction), nic (network bandwidth of one node, one
direction), mem (device memory), nvlink_latency, nic_latency, speed (a factor on the device's peak FLOP/s
and memory bandwidth, e.g. speed=0.33 for a device three times slower than its catalog entry; how the
CPU tests describe ranks slowed down on purpose). A TOML file gives the same per group,
plus `between_groups` (bandwidth per node between two groups) and `between_groups_latency`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import SpecError, require
from fivefold.spec.checks import MAX_DEVICES, check_count, check_table, is_real
from fivefold.spec.devices import CATALOG, DeviceSpec, device_named
from fivefold.spec.units import (format_bandwidth, format_size, format_time, parse_bandwidth, parse_size, parse_time,
                                 read_toml_file)

_GROUP = re.compile(r"^(?:(\d+)x)?(\d+)x([A-Za-z0-9_.\-]+)$")
GROUP_KEYS = ("nvlink", "nic", "mem", "nvlink_latency", "nic_latency", "speed")


@dataclass(frozen=True)
class HostCosts:
    """Host (CPU) seconds of fivefold's eager PyTorch runtime, measured by `fivefold profile` on CPU ranks
    with the runtime's own model code at a negligible size (so the time is Python, module calls, the
    dispatcher and autograd, not arithmetic). 0 = not measured."""

    op_forward: float = 0.0  # per op dispatched in a forward pass
    op_backward: float = 0.0  # per op the autograd engine runs in a backward pass
    dtensor_op_forward: float = 0.0  # forward, tensor-parallel block (DTensor), per op of the plain block
    dtensor_op_backward: float = 0.0  # backward, likewise
    tp_collective: float = 0.0  # what one DTensor collective (2-rank TP) costs beyond the bare collective
    fsdp_unit_forward: float = 0.0  # FSDP2 / replicate hooks of one wrapped module in one forward
    fsdp_unit_backward: float = 0.0  # ... in one backward
    fsdp_gather: float = 0.0  # what one wrapped module's parameter all-gather costs beyond the bare collective
    fsdp_reduce: float = 0.0  # what one wrapped module's gradient reduction costs beyond the bare collective
    optimizer_tensor: float = 0.0  # AdamW step (CPU: one tensor at a time) per plain parameter tensor
    optimizer_dtensor: float = 0.0  # per DTensor parameter (FSDP / replicate / TP shards)
    # The zero-bubble schedules' split backward (torch.distributed.pipelining stage_backward_input, then
    # stage_backward_weight: one autograd.grad call per parameter group) beyond one full backward, per
    # micro-batch of a stage model that is not the first: per layer of the stage, and per pair of its layers
    # (each weight-gradient call walks the autograd graph of every layer beneath it in the stage).
    split_backward_layer: float = 0.0
    split_backward_layer_pair: float = 0.0
    # How much of an asynchronous gradient reduction still lengthens the backward it runs beside, per second
    # of the bare collective's byte-moving part, with every rank computing (a dimensionless factor: 0 =
    # hidden; 1 = in series; more = slower than alone). On CPU ranks the collective's copies and sums take
    # the cores the backward computes on.
    overlapped_collective: float = 0.0
    # The serving engine's host work (`fivefold serve` / `generate`, profile/serving.py): per step, per request in
    # the step, per layer of a stage per step, per extra attention call per layer (each prefill chunk attends
    # alone), and one step's trip to a worker process and back (layouts on worker processes; a pipeline's every
    # further stage pays it again, cost/serving.py).
    serve_step: float = 0.0
    serve_request: float = 0.0
    serve_layer: float = 0.0
    serve_attention_group: float = 0.0
    serve_worker_step: float = 0.0
    # What the first step after the engine sleeps (no request to run) takes beyond the same step run right after
    # another, in wall seconds: caches, TLBs and branch predictors refilled, the core woken.
    serve_wake: float = 0.0
    # Of the time the serving probe was runnable, the share it spent on a core (local.CpuShare; 1 = it had a core
    # to itself): a run that gets a smaller share on a shared machine takes longer in proportion. 0 = not recorded.
    serve_cpu_share: float = 0.0

    @property
    def serving(self) -> bool:
        """The serving engine's host costs were measured (a profile older than profile/serving.py has none)."""
        return self.serve_step > 0 or self.serve_layer > 0

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in HOST_COST_FIELDS}


HOST_COST_FIELDS = tuple(HostCosts.__dataclass_fields__)


@dataclass(frozen=True)
class Calibration:
    """Curves measured by `fivefold profile` on one device type; the cost model interpolates over them."""

    gemm: tuple[tuple[int, int, int, str, float], ...] = ()  # (m, n, k, dtype, FLOP/s)
    collectives: tuple[tuple[str, int, int, float], ...] = ()  # (collective, ranks, message bytes, seconds)
    source: str = ""  # where and when it was measured
    host: HostCosts | None = None  # eager-runtime host costs (CPU profiles), None = not measured
    processes: int = 0  # ranks measuring at once (GEMMs, memory, host costs share the machine); 0 = one alone
    threads: int = 0  # intra-op threads per rank during those measurements; 0 = not recorded

    def to_dict(self) -> dict:
        out: dict[str, object] = {"source": self.source,
               "gemm": [{"m": m, "n": n, "k": k, "dtype": d, "flops_per_s": f} for m, n, k, d, f in self.gemm],
               "collective": [{"collective": c, "ranks": r, "message_bytes": b, "seconds": t}
                              for c, r, b, t in self.collectives]}
        if self.processes:
            out["processes"] = self.processes
        if self.threads:
            out["threads"] = self.threads
        if self.host is not None:
            out["host"] = self.host.to_dict()
        return out


def calibration_from_dict(data: dict, where: str) -> Calibration:
    check_table(data, f"{where}.calibration", "write a table as `fivefold profile` does; regenerate the file")
    try:
        gemm = tuple((int(p["m"]), int(p["n"]), int(p["k"]), str(p["dtype"]), float(p["flops_per_s"]))
                     for p in data.get("gemm", []))
        collectives = tuple((str(p["collective"]), int(p["ranks"]), int(p["message_bytes"]), float(p["seconds"]))
                            for p in data.get("collective", []))
        processes, threads = int(data.get("processes", 0)), int(data.get("threads", 0))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SpecError(f"{where}.calibration", type(exc).__name__, f"malformed measured point ({exc}); "
                        "regenerate the file with `fivefold profile`") from None
    host = None
    if "host" in data:
        table = data["host"]
        require(isinstance(table, dict), f"{where}.calibration.host", table,
                f"write a table of {', '.join(HOST_COST_FIELDS)} (seconds)")
        for key, value in table.items():
            require(key in HOST_COST_FIELDS, f"{where}.calibration.host.{key}", value,
                    f"unknown key; known: {', '.join(HOST_COST_FIELDS)}")
            require(is_real(value) and value >= 0, f"{where}.calibration.host.{key}", value,
                    "must be a non-negative number (seconds; overlapped_collective: a factor)")
        host = HostCosts(**{key: float(value) for key, value in table.items()})
    return Calibration(gemm, collectives, str(data.get("source", "")), host, processes, threads)


@dataclass(frozen=True)
class NodeGroup:
    """`nodes` identical nodes of `gpus_per_node` devices each."""

    nodes: int  # node count
    gpus_per_node: int  # devices per node
    device: DeviceSpec  # device type (with any overrides applied)
    intra_node_bandwidth: float  # bytes/s per device, one direction
    network_bandwidth: float  # bytes/s per node, one direction
    intra_node_latency: float  # seconds
    network_latency: float  # seconds
    calibration: Calibration | None = None  # measured curves from `fivefold profile`, if any

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}x{self.device.name}"


@dataclass(frozen=True)
class Link:
    """A point-to-point path between two devices."""

    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds
    kind: str  # "self", "intra" (NVLink/xGMI/PCIe/shm) or "network"


@dataclass(frozen=True)
class DeviceSlot:
    """Where one device sits: its global index, group, node and local index."""

    index: int
    group: int
    node: int  # global node index
    local: int  # index inside the node


@dataclass(frozen=True)
class ClusterSpec:
    groups: tuple[NodeGroup, ...]  # one or more groups of identical nodes
    between_groups_bandwidth: float | None = None  # bytes/s per node across groups; None = slower NIC
    between_groups_latency: float | None = None  # seconds; None = larger NIC latency

    def __post_init__(self) -> None:
        require(len(self.groups) > 0, "cluster", "", "needs at least one group")
        # Before anything lists the devices (slots, placement): answer an absurd size at once.
        require(self.world_size <= MAX_DEVICES, "cluster", self.label,
                f"has {self.world_size:,} devices; fivefold plans clusters of up to {MAX_DEVICES:,}")

    @property
    def world_size(self) -> int:
        return sum(g.world_size for g in self.groups)

    @property
    def is_homogeneous(self) -> bool:
        first = self.groups[0]
        return all(g.device == first.device and g.gpus_per_node == first.gpus_per_node
                   and g.network_bandwidth == first.network_bandwidth for g in self.groups)

    @property
    def label(self) -> str:
        return "+".join(g.label for g in self.groups)

    def slots(self) -> list[DeviceSlot]:
        out: list[DeviceSlot] = []
        node = 0
        for group_index, group in enumerate(self.groups):
            for _ in range(group.nodes):
                for local in range(group.gpus_per_node):
                    out.append(DeviceSlot(len(out), group_index, node, local))
                node += 1
        return out

    def group_of(self, device_index: int) -> NodeGroup:
        return self.groups[self.slots()[device_index].group]

    def link(self, a: int, b: int) -> Link:
        """The path between devices a and b (global indices)."""
        slots = self.slots()
        sa, sb = slots[a], slots[b]
        ga, gb = self.groups[sa.group], self.groups[sb.group]
        if a == b:
            return Link(float("inf"), 0.0, "self")
        if sa.node == sb.node:
            return Link(ga.intra_node_bandwidth, ga.intra_node_latency, "intra")
        bandwidth = min(ga.network_bandwidth, gb.network_bandwidth)
        latency = max(ga.network_latency, gb.network_latency)
        if sa.group != sb.group:
            bandwidth = self.between_groups_bandwidth or bandwidth
            latency = self.between_groups_latency or latency
        return Link(bandwidth, latency, "network")

    def to_dict(self) -> dict:
        """The TOML form; device fields that differ from the catalog are written out."""
        groups = []
        for g in self.groups:
            entry: dict = {"nodes": g.nodes, "gpus_per_node": g.gpus_per_node, "device": g.device.name,
                           "nvlink": format_bandwidth(g.intra_node_bandwidth),
                           "nic": format_bandwidth(g.network_bandwidth),
                           "nvlink_latency": format_time(g.intra_node_latency),
                           "nic_latency": format_time(g.network_latency),
                           "mem": format_size(g.device.memory_bytes)}
            base = CATALOG.get(g.device.name)
            if base is None or g.device.peak_flops != base.peak_flops:
                entry["peak_tflops"] = {k: v / 1e12 for k, v in g.device.peak_flops.items()}
            if base is None or g.device.memory_bandwidth != base.memory_bandwidth:
                entry["memory_bandwidth"] = format_bandwidth(g.device.memory_bandwidth)
            if g.calibration is not None:
                entry["calibration"] = g.calibration.to_dict()
            groups.append(entry)
        out: dict = {"group": groups}
        if self.between_groups_bandwidth is not None:
            out["between_groups"] = format_bandwidth(self.between_groups_bandwidth)
        if self.between_groups_latency is not None:
            out["between_groups_latency"] = format_time(self.between_groups_latency)
        return out


def _parse_speed(value: object, where: str) -> float:
    try:
        speed = float(value) if not isinstance(value, bool) else 0.0  # type: ignore[arg-type]
    except (TypeError, ValueError):
        speed = 0.0
    require(math.isfinite(speed) and speed > 0, where, value, "write a positive factor on peak FLOP/s and memory bandwidth, e.g. 0.5")
    return speed


def _make_group(nodes: int, gpus: int, device: DeviceSpec, settings: dict, where: str) -> NodeGroup:
    check_count(nodes, f"{where}.nodes", limit=MAX_DEVICES)
    check_count(gpus, f"{where}.gpus_per_node", limit=MAX_DEVICES)
    changes: dict = {}
    if "mem" in settings:
        changes["memory_bytes"] = parse_size(settings["mem"], f"{where}.mem")
    if "memory_bandwidth" in settings:
        changes["memory_bandwidth"] = parse_bandwidth(settings["memory_bandwidth"], f"{where}.memory_bandwidth")
    if "peak_tflops" in settings:
        table = settings["peak_tflops"]
        require(isinstance(table, dict) and all(is_real(v) and v > 0 for v in table.values()),
                f"{where}.peak_tflops", table, "write a table of dtype = positive TFLOP/s")
        changes["peak_flops"] = {k: float(v) * 1e12 for k, v in table.items()}
    if "speed" in settings:
        speed = _parse_speed(settings["speed"], f"{where}.speed")
        changes["peak_flops"] = {k: v * speed for k, v in changes.get("peak_flops", device.peak_flops).items()}
        changes["memory_bandwidth"] = changes.get("memory_bandwidth", device.memory_bandwidth) * speed
    if changes:
        device = device.with_overrides(**changes)
    return NodeGroup(
        nodes=nodes, gpus_per_node=gpus, device=device,
        intra_node_bandwidth=parse_bandwidth(settings["nvlink"], f"{where}.nvlink")
        if "nvlink" in settings else device.intra_node_bandwidth,
        network_bandwidth=parse_bandwidth(settings["nic"], f"{where}.nic")
        if "nic" in settings else device.network_bandwidth,
        intra_node_latency=parse_time(settings["nvlink_latency"], f"{where}.nvlink_latency")
        if "nvlink_latency" in settings else device.intra_node_latency,
        network_latency=parse_time(settings["nic_latency"], f"{where}.nic_latency")
        if "nic_latency" in settings else device.network_latency,
        calibration=calibration_from_dict(settings["calibration"], where) if "calibration" in settings else None,
    )


def parse_cluster_shorthand(text: str) -> ClusterSpec:
    groups = []
    for index, part in enumerate(text.strip().split("+")):
        shape, _, options = part.strip().partition(":")
        match = _GROUP.match(shape.strip())
        if not match:
            raise SpecError("--cluster", part, "malformed group; write NODESxGPUSxDEVICE[:key=value,...], "
                                               "e.g. 2x8xH100-SXM:nic=400Gb/s")
        nodes = int(match.group(1) or 1)
        gpus = int(match.group(2))
        device = device_named(match.group(3), field_name=f"cluster group {index} device")
        settings: dict[str, str] = {}
        for item in filter(None, (o.strip() for o in options.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise SpecError("--cluster", item, "malformed option; write key=value, e.g. nic=400Gb/s")
            if key not in GROUP_KEYS:
                raise SpecError(f"cluster group {index} option", key, f"unknown key; known: {', '.join(GROUP_KEYS)}")
            settings[key] = value
        groups.append(_make_group(nodes, gpus, device, settings, f"cluster group {index}"))
    return ClusterSpec(tuple(groups))


def cluster_from_dict(data: dict, where: str = "cluster") -> ClusterSpec:
    check_table(data, where, "write [[cluster.group]] tables with nodes, gpus_per_node, device")
    entries = data.get("group")
    shape = "write one or more [[cluster.group]] tables with nodes, gpus_per_node, device"
    require(isinstance(entries, list) and len(entries) > 0, f"{where}.group", entries, shape)
    allowed = set(GROUP_KEYS) | {"nodes", "gpus_per_node", "device", "peak_tflops", "memory_bandwidth", "calibration"}
    groups = []
    for index, entry in enumerate(entries or ()):
        here = f"{where}.group[{index}]"
        check_table(entry, here, shape)
        for key in entry:
            require(key in allowed, f"{here}.{key}", entry[key], f"unknown key; known: {', '.join(sorted(allowed))}")
        require("device" in entry, f"{here}.device", None, f"missing; known: {', '.join(CATALOG)}")
        device = device_named(str(entry["device"]), field_name=f"{here}.device")
        groups.append(_make_group(entry.get("nodes", 1), entry.get("gpus_per_node", device.gpus_per_node),
                                  device, entry, here))
    between = data.get("between_groups")
    between_latency = data.get("between_groups_latency")
    return ClusterSpec(
        tuple(groups),
        parse_bandwidth(between, f"{where}.between_groups") if between is not None else None,
        parse_time(between_latency, f"{where}.between_groups_latency") if between_latency is not None else None,
    )


def parse_cluster(text: str) -> ClusterSpec:
    """Shorthand, or the path of a TOML file with a [cluster] table (or top-level [[group]] tables)."""
    if text.endswith(".toml") or Path(text).is_file():
        data = read_toml_file(text, "--cluster")
        return cluster_from_dict(data.get("cluster", data))
    return parse_cluster_shorthand(text)
