"""Device catalog and ClusterSpec: shorthand, TOML, links, and every error path."""

import pytest

from fivefold.errors import SpecError
from fivefold.spec import CATALOG, device_named, parse_cluster
from fivefold.spec.units import parse_bandwidth, parse_size, parse_time

REQUIRED_DEVICES = ["A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "L40S", "RTX-4090",
                    "MI300X", "cpu"]


def test_catalog_has_every_device_with_dtype_peaks():
    for name in REQUIRED_DEVICES:
        device = CATALOG[name]
        assert device.peak_flops["fp32"] > 0 and device.peak_flops["bf16"] >= device.peak_flops["fp32"] / 2
        assert device.memory_bytes > 0 and device.memory_bandwidth > 0
        assert device.intra_node_bandwidth > 0 and device.network_bandwidth > 0
    assert CATALOG["H100-SXM"].flops("bf16") == pytest.approx(989.4e12)
    assert CATALOG["A100-80GB"].flops("fp32") == pytest.approx(156e12)  # fp32 training runs on TF32 cores
    assert "fp8" in CATALOG["H100-SXM"].peak_flops and "fp8" not in CATALOG["A100-80GB"].peak_flops
    assert device_named("h100-sxm").name == "H100-SXM"


def test_units():
    assert parse_bandwidth("400Gb/s", "x") == 50e9
    assert parse_bandwidth("150GB/s", "x") == 150e9
    assert parse_bandwidth(25, "x") == 25e9
    assert parse_size("80GiB", "x") == 80 * 2**30
    assert parse_time("5us", "x") == 5e-6
    for bad, fn in (("fast", parse_bandwidth), ("10furlongs/s", parse_bandwidth), ("-3GB", parse_size),
                    ("0us", parse_time)):
        with pytest.raises(SpecError):
            fn(bad, "x")


def test_shorthand_mixed_cluster_and_links():
    cluster = parse_cluster("2x8xA100-80GB+2x8xH100-SXM:nic=400Gb/s,nvlink=400GB/s")
    assert cluster.world_size == 32 and not cluster.is_homogeneous
    a100, h100 = cluster.groups
    assert a100.network_bandwidth == 200e9  # DGX A100: 8 x 200 Gb/s
    assert h100.network_bandwidth == 50e9 and h100.intra_node_bandwidth == 400e9
    assert cluster.link(0, 7).kind == "intra" and cluster.link(0, 7).bandwidth == 300e9
    assert cluster.link(0, 8).kind == "network" and cluster.link(0, 8).bandwidth == 200e9
    assert cluster.link(0, 16).bandwidth == 50e9  # the slower NIC of the two nodes
    assert cluster.link(3, 3).kind == "self"
    single = parse_cluster("8xH100")
    assert single.world_size == 8 and len(single.groups) == 1 and single.groups[0].nodes == 1


def test_toml_cluster_with_between_groups_and_latencies(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("""
[cluster]
between_groups = "100Gb/s"
between_groups_latency = "30us"
[[cluster.group]]
nodes = 2
gpus_per_node = 8
device = "A100-80GB"
nic_latency = "8us"
[[cluster.group]]
nodes = 2
gpus_per_node = 8
device = "H100-SXM"
mem = "94GB"
peak_tflops = { bf16 = 800.0, fp32 = 60.0 }
""")
    cluster = parse_cluster(str(path))
    assert cluster.world_size == 32
    assert cluster.link(0, 8).latency == 8e-6
    assert cluster.link(0, 16).bandwidth == 100e9 / 8 and cluster.link(0, 16).latency == 30e-6
    assert cluster.groups[1].device.memory_bytes == 94e9
    assert cluster.groups[1].device.flops("bf16") == 800e12


@pytest.mark.parametrize("text, words", [
    ("1x8xV100", "unknown device; known: A100-40GB"),
    ("2x8", "unknown device"),
    ("two x 8 x H100", "malformed group"),
    ("2x8xH100:foo=1", "unknown key; known: nvlink, nic"),
    ("2x8xH100:nic", "malformed option"),
    ("2x8xH100:nic=fast", "expected a number with a unit"),
    ("2x8xH100:nic=0Gb/s", "must be positive"),
    ("0x8xH100", "must be a positive integer"),
    ("2x8xH100+", "malformed group"),
])
def test_cluster_errors(text, words):
    with pytest.raises(SpecError) as info:
        parse_cluster(text)
    assert words in str(info.value)


def test_cluster_file_errors(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        parse_cluster(str(tmp_path / "nope.toml"))
    path = tmp_path / "c.toml"
    path.write_text("[cluster]\n")
    with pytest.raises(SpecError, match=r"\[\[cluster.group\]\]"):
        parse_cluster(str(path))
    path.write_text('[[cluster.group]]\nnodes = 1\ndevice = "H100"\ncolour = "red"\n')
    with pytest.raises(SpecError, match="unknown key"):
        parse_cluster(str(path))
    path.write_text('[[cluster.group]]\nnodes = 1\n')
    with pytest.raises(SpecError, match="device"):
        parse_cluster(str(path))
