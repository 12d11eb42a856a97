"""`fivefold profile`: run the measurements and write a profile file that `--cluster` accepts.

The file is a cluster TOML (one group: this machine, with the measured peak GEMM rates, memory bandwidth
and link bandwidth/latency replacing the catalog defaults) plus a [profile] table holding every measured
point, which the cost model interpolates over shapes and message sizes.

On CPU every measurement runs in N worker processes at once (profile/workers.py), so the file describes
what one of N ranks gets on this machine, including the host costs of the eager runtime (profile/host.py);
profile each process count you train with.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from fivefold.profile.collectives import CollectivePoint
from fivefold.profile.kernels import GemmPoint, measure_gemm, measure_memory_bandwidth
from fivefold.profile.workers import measure_collectives, measure_on_ranks
from fivefold.spec.cluster import HostCosts
from fivefold.spec.units import format_bandwidth, format_size, format_time


@dataclass
class Profile:
    device: str  # catalog name the measurements refine ("cpu", "H100-SXM", ...)
    processes: int  # ranks in the collective measurements (devices of this node)
    quick: bool  # quick grid (under a minute on a small machine)
    memory_bandwidth: float  # bytes/s (STREAM copy)
    memory_bytes: float  # memory one rank may use
    gemm: list[GemmPoint] = field(default_factory=list)
    collectives: list[CollectivePoint] = field(default_factory=list)
    host_costs: HostCosts | None = None  # eager-runtime host costs (CPU)
    threads: int = 0  # intra-op threads per rank during the GEMM / memory / host measurements (CPU)
    host: str = field(default_factory=socket.gethostname)
    date: str = field(default_factory=lambda: datetime.datetime.now().isoformat(timespec="seconds"))

    def peak_flops(self) -> dict[str, float]:
        """Best measured GEMM rate per dtype: the compute ceiling the cost model scales efficiencies to."""
        best: dict[str, float] = {}
        for point in self.gemm:
            best[point.dtype] = max(best.get(point.dtype, 0.0), point.flops_per_s)
        return best

    def link(self) -> tuple[float, float]:
        """(bandwidth at the largest message, latency at the smallest) of send/recv between two ranks."""
        points = sorted((p for p in self.collectives if p.collective == "send_recv"), key=lambda p: p.message_bytes)
        if not points:
            return 0.0, 0.0
        return points[-1].bus_bandwidth, points[0].seconds

    def to_dict(self) -> dict:
        group = {"nodes": 1, "gpus_per_node": self.processes, "device": self.device,
                 "peak_tflops": {k: v / 1e12 for k, v in self.peak_flops().items()},
                 "memory_bandwidth": format_bandwidth(self.memory_bandwidth),
                 "mem": format_size(self.memory_bytes)}
        group["calibration"] = {
            "source": f"fivefold profile on {self.host}, {self.date}",
            "gemm": [{"m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype, "flops_per_s": p.flops_per_s}
                     for p in self.gemm],
            "collective": [{"collective": p.collective, "ranks": p.ranks, "message_bytes": p.message_bytes,
                            "seconds": p.seconds} for p in self.collectives],
        }
        if self.device == "cpu":  # every rank measured at once (profile/workers.py)
            group["calibration"].update(processes=self.processes, threads=self.threads)
        if self.host_costs is not None:
            group["calibration"]["host"] = self.host_costs.to_dict()
        bandwidth, latency = self.link()
        if bandwidth:
            group["nvlink"] = format_bandwidth(bandwidth)
            group["nvlink_latency"] = format_time(latency)
        return {
            "cluster": {"group": [group]},
            "profile": {
                "host": self.host, "date": self.date, "device": self.device, "processes": self.processes,
                "quick": self.quick, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                "memory_bandwidth": self.memory_bandwidth,
                "bus_bandwidth": [{"collective": p.collective, "message_bytes": p.message_bytes,
                                   "bus_bandwidth": p.bus_bandwidth} for p in self.collectives],
            },
        }

    def save(self, path: str | Path) -> None:
        import tomli_w

        header = (f"# fivefold profile of {self.host} ({self.device}, {self.processes} processes), {self.date}\n"
                  "# Use it as --cluster FILE; edit `nodes` to describe several such machines.\n")
        Path(path).write_text(header + tomli_w.dumps(self.to_dict()))


_CUDA_NAMES = (("H200", "H200"), ("H100 PCIe", "H100-PCIe"), ("H100", "H100-SXM"), ("B200", "B200"),
               ("A100-SXM4-40GB", "A100-40GB"), ("A100-PCIE-40GB", "A100-40GB"), ("A100", "A100-80GB"),
               ("L40S", "L40S"), ("4090", "RTX-4090"), ("MI300X", "MI300X"))


def catalog_name_of_cuda_device(index: int = 0) -> str:
    name = torch.cuda.get_device_name(index)
    for fragment, catalog_name in _CUDA_NAMES:
        if fragment in name:
            return catalog_name
    return "H100-SXM"  # an unknown GPU: start from a modern default; the measured numbers replace it


def physical_memory_bytes() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_profile(processes: int, quick: bool, use_cuda: bool | None = None,
                on_step: Callable[[str, object], None] | None = None) -> Profile:
    """On CPU, measure GEMMs, memory and host costs in `processes` ranks at once, then collectives; on a
    GPU, GEMMs and memory on device 0, then collectives over `processes` local ranks."""
    use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    report = on_step or (lambda kind, item: None)
    if not use_cuda:
        measured = measure_on_ranks(processes, quick, use_cuda=False, compute=True, on_step=report)
        if measured.host is not None and processes > 1:  # the serving engine's worker processes (profile/serving.py)
            from dataclasses import replace

            from fivefold.profile.serving import measure_worker_step

            measured.host = replace(measured.host, **measure_worker_step(quick))
        return Profile(device="cpu", processes=processes, quick=quick, memory_bandwidth=measured.memory_bandwidth,
                       memory_bytes=physical_memory_bytes() / max(processes, 1), gemm=measured.gemm,
                       collectives=measured.collectives, host_costs=measured.host, threads=measured.threads)
    device = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 training runs on TF32 tensor cores
    gemm = measure_gemm(device, ["bf16", "fp16", "fp32"], quick, on_point=lambda p: report("gemm", p))
    memory_bandwidth = measure_memory_bandwidth(device, quick)
    report("memory", memory_bandwidth)
    name, memory = catalog_name_of_cuda_device(), torch.cuda.get_device_properties(0).total_memory
    collectives = []
    if processes > 1:
        collectives = measure_collectives(processes, quick, use_cuda, on_point=lambda p: report("collective", p))
    return Profile(device=name, processes=processes, quick=quick, memory_bandwidth=memory_bandwidth,
                   memory_bytes=float(memory), gemm=gemm, collectives=collectives)
