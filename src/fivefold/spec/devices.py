"""The device catalog: peak dense FLOP/s per dtype, memory, bandwidths.

Figures are vendor datasheet numbers for dense (not 2:4 sparse) math:
- A100: NVIDIA A100 Tensor Core GPU datasheet (2021); DGX A100 has 8x 200 Gb/s HDR per node.
- H100 SXM / PCIe: NVIDIA H100 datasheet (2023); DGX H100 has 8x 400 Gb/s NDR per node.
- H100-96GB: the 96 GB HBM2e H100 of Meta's Grand Teton hosts run at a 500 W power limit (TorchTitan's
  H100 benchmarks): its peaks lie between H100 SXM and NVL, the exact figure unpublished, so the midpoint;
  six HBM2e stacks as the 80 GB PCIe part has five (2.0 TB/s) give 2.4 TB/s; 400 Gb/s RDMA per GPU.
- H200: NVIDIA H200 datasheet (2024); same compute as H100 SXM.
- B200: NVIDIA DGX B200 datasheet (2024), per GPU = system / 8.
- L40S: NVIDIA L40S datasheet (2023). RTX-4090: NVIDIA Ada architecture whitepaper, Appendix A
  (bf16/fp8 with fp32 accumulate).
- MI300X: AMD Instinct MI300X datasheet (2023); 7 Infinity Fabric links of 64 GB/s per direction.
- cpu: a placeholder for one CPU worker process; `fivefold profile` measures the real machine.
Intra-node bandwidth is per GPU, one direction; network bandwidth is per node, one direction.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.errors import SpecError
from fivefold.spec.units import GIB

TFLOPS = 1e12
GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator type."""

    name: str  # catalog name
    peak_flops: dict[str, float]  # dense peak FLOP/s by dtype: fp32, tf32, bf16, fp16, fp8
    memory_bytes: float  # device memory capacity
    memory_bandwidth: float  # bytes/s of device memory
    intra_node_bandwidth: float  # bytes/s per GPU, one direction (NVLink, xGMI or PCIe)
    network_bandwidth: float  # bytes/s per node, one direction (all NICs together)
    intra_node_link: str = "nvlink"  # "nvlink", "xgmi", "pcie" or "shm"
    gpus_per_node: int = 8  # typical node size, used when the shorthand omits it
    intra_node_latency: float = 5e-6  # seconds per hop inside a node
    network_latency: float = 10e-6  # seconds per hop between nodes

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for a training dtype; fp32 training uses TF32 tensor cores where they exist."""
        if dtype == "fp32" and "tf32" in self.peak_flops:
            return self.peak_flops["tf32"]
        if dtype == "fp8" and dtype not in self.peak_flops:
            raise SpecError("train.dtype", dtype, f"{self.name} has no FP8 tensor cores (FP8 training needs H100, "
                            "H200, B200, L40S, RTX-4090 or MI300X); train in bf16")
        if dtype not in self.peak_flops:
            raise SpecError("train.dtype", dtype,
                            f"{self.name} has no {dtype} peak; known: {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def with_overrides(self, **changes: object) -> DeviceSpec:
        values = {**self.__dict__, **changes}
        return DeviceSpec(**values)


def _gpu(name: str, fp32: float, tf32: float | None, bf16: float, fp8: float | None, memory_gb: float,
         memory_tb_s: float, intra_gb_s: float, network_gbit_s: float, link: str = "nvlink") -> DeviceSpec:
    flops = {"fp32": fp32 * TFLOPS, "bf16": bf16 * TFLOPS, "fp16": bf16 * TFLOPS}
    if tf32 is not None:
        flops["tf32"] = tf32 * TFLOPS
    if fp8 is not None:
        flops["fp8"] = fp8 * TFLOPS
    return DeviceSpec(name=name, peak_flops=flops, memory_bytes=memory_gb * GB,
                      memory_bandwidth=memory_tb_s * 1e12, intra_node_bandwidth=intra_gb_s * GB,
                      network_bandwidth=network_gbit_s * GB / 8, intra_node_link=link)


CATALOG: dict[str, DeviceSpec] = {d.name: d for d in [
    #    name         fp32   tf32    bf16    fp8   mem GB  TB/s  intra GB/s  net Gb/s
    _gpu("A100-40GB", 19.5, 156.0, 312.0, None, 40, 1.555, 300, 1600),
    _gpu("A100-80GB", 19.5, 156.0, 312.0, None, 80, 2.039, 300, 1600),
    _gpu("H100-SXM", 67.0, 494.7, 989.4, 1978.9, 80, 3.35, 450, 3200),
    _gpu("H100-PCIe", 51.0, 378.0, 756.0, 1513.0, 80, 2.0, 64, 800, link="pcie"),
    _gpu("H100-96GB", 63.0, 456.0, 912.0, 1824.0, 96, 2.4, 450, 3200),
    _gpu("H200", 67.0, 494.7, 989.4, 1978.9, 141, 4.8, 450, 3200),
    _gpu("B200", 75.0, 1100.0, 2250.0, 4500.0, 180, 8.0, 900, 3200),
    _gpu("L40S", 91.6, 183.0, 362.0, 733.0, 48, 0.864, 32, 400, link="pcie"),
    _gpu("RTX-4090", 82.6, 82.6, 165.2, 330.3, 24, 1.008, 32, 100, link="pcie"),
    _gpu("MI300X", 163.4, 653.7, 1307.4, 2614.9, 192, 5.3, 448, 3200, link="xgmi"),
    DeviceSpec(name="cpu", peak_flops={"fp32": 100e9, "bf16": 50e9, "fp16": 25e9},
               memory_bytes=16 * GIB, memory_bandwidth=20e9, intra_node_bandwidth=5e9,
               network_bandwidth=10e9 / 8, intra_node_link="shm", gpus_per_node=1,
               intra_node_latency=50e-6, network_latency=100e-6),
]}

_ALIASES = {name.lower(): name for name in CATALOG}
_ALIASES.update({"a100": "A100-80GB", "h100": "H100-SXM", "mi300": "MI300X", "4090": "RTX-4090"})


def device_named(name: str, field_name: str = "device") -> DeviceSpec:
    """Look a device up by catalog name (case-insensitive); unknown names list the known ones."""
    key = _ALIASES.get(name.strip().lower())
    if key is None:
        raise SpecError(field_name, name, f"unknown device; known: {', '.join(CATALOG)}")
    return CATALOG[key]
