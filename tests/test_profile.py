"""`fivefold profile`: measured numbers are sane and the profile file is a cluster that --cluster accepts."""

import pytest

from fivefold.cli import main
from fivefold.profile.collectives import bus_factor
from fivefold.spec import parse_cluster


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("send_recv", 2) == 1.0


@pytest.mark.slow
def test_quick_profile_writes_a_usable_cluster_file(tmp_path, capsys):
    out = tmp_path / "profile.toml"
    assert main(["profile", "--quick", "--nproc", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "best GEMM fp32" in printed and "send_recv" in printed
    cluster = parse_cluster(str(out))
    device = cluster.groups[0].device
    # A CPU core does somewhere between 1 GFLOP/s and 10 TFLOP/s of fp32 GEMM; far outside means a broken timer.
    assert 1e9 < device.flops("fp32") < 1e13
    assert 1e8 < device.memory_bandwidth < 1e12
    assert cluster.world_size == 2
    assert 1e6 < cluster.groups[0].intra_node_bandwidth < 1e12
    assert 0 < cluster.groups[0].intra_node_latency < 0.1
    import tomllib
    data = tomllib.loads(out.read_text())
    kinds = {point["collective"] for point in data["profile"]["collective"]}
    assert kinds == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
    sizes = sorted({p["message_bytes"] for p in data["profile"]["collective"]})
    assert sizes[0] == 4096 and sizes[-1] == 4 * 2**20
