"""Measured curves (`fivefold profile` calibrations): interpolated GEMM rates and collective times, and what
they change in an estimate."""

import dataclasses
import math

import pytest

from fivefold.cost import estimate
from fivefold.cost.comm import all_gather_time, all_reduce_time, reduce_scatter_time, topology_of
from fivefold.cost.compute import Device, gemm_time
from fivefold.spec import CATALOG, PRESETS, Plan, TrainSpec, parse_cluster
from fivefold.spec.cluster import Calibration, ClusterSpec

MIB = 2**20
# Square bf16 GEMMs: arithmetic intensity 2n^3 / (3 n^2 x 2 bytes) = n / 3 FLOPs per byte.
GEMMS = ((1024, 1024, 1024, "bf16", 2e14), (4096, 4096, 4096, "bf16", 6e14), (8192, 8192, 8192, "bf16", 7e14),
         (1024, 1024, 1024, "fp32", 1e13))
COLLECTIVES = (("all_reduce", 8, 1 * MIB, 50e-6), ("all_reduce", 8, 16 * MIB, 200e-6),
               ("all_reduce", 8, 64 * MIB, 700e-6), ("all_gather", 8, 1 * MIB, 40e-6),
               ("all_gather", 8, 16 * MIB, 400e-6), ("reduce_scatter", 8, 8 * MIB, 90e-6),
               ("reduce_scatter", 8, 64 * MIB, 600e-6), ("send_recv", 8, 1 * MIB, 20e-6),
               ("send_recv", 8, 64 * MIB, 500e-6))


def calibrated(cluster: str, gemm=GEMMS, collectives=COLLECTIVES) -> ClusterSpec:
    spec = parse_cluster(cluster)
    group = dataclasses.replace(spec.groups[0], calibration=Calibration(tuple(gemm), tuple(collectives), "test"))
    return ClusterSpec((group,))


def test_gemm_rate_is_interpolated_in_log_space_over_intensity():
    device = Device(CATALOG["H100-SXM"], "bf16", calibrated("1x8xH100-SXM").groups[0].calibration)
    # 2048^3 sits halfway (in log intensity) between 1024^3 and 4096^3: the geometric mean of their rates.
    assert gemm_time(device, 2048, 2048, 2048) == pytest.approx(2 * 2048**3 / math.sqrt(2e14 * 6e14), rel=1e-12)
    assert gemm_time(device, 4096, 4096, 4096) == pytest.approx(2 * 4096**3 / 6e14, rel=1e-12)  # a measured point
    # Outside the measured range the end rates hold (clamped), and no kernel is faster than a launch.
    assert gemm_time(device, 16384, 16384, 16384) == pytest.approx(2 * 16384**3 / 7e14, rel=1e-12)
    assert gemm_time(device, 512, 512, 512) == pytest.approx(max(2 * 512**3 / 2e14, 5e-6), rel=1e-12)
    assert gemm_time(device, 64, 64, 64) == pytest.approx(5e-6)  # Hopper's launch (cost/kernels.py)
    # A skinny GEMM of the same FLOPs moves more bytes per FLOP: lower intensity, lower rate, more time.
    assert gemm_time(device, 8192, 8192, 128) > gemm_time(device, 2048, 2048, 2048)
    # Fused attention scales with the best measured GEMM; a dtype without points keeps the catalog curve.
    assert device.gemm_peak == pytest.approx(7e14)
    fp16 = Device(CATALOG["H100-SXM"], "fp16", calibrated("1x8xH100-SXM").groups[0].calibration)
    assert fp16.gemm_curve is None and gemm_time(fp16, 2048, 2048, 2048) == gemm_time(
        Device(CATALOG["H100-SXM"], "fp16"), 2048, 2048, 2048)


def test_collective_times_come_from_the_measured_curves():
    cluster = calibrated("1x8xH100-SXM")
    topology = topology_of(cluster)
    eight, four = topology.group_link(list(range(8))), topology.group_link([0, 1, 2, 3])
    # Inside the measured sizes: log-log interpolation (4 MiB is halfway between 1 and 16 MiB in log size).
    assert all_reduce_time(4 * MIB, eight) == pytest.approx(math.sqrt(50e-6 * 200e-6), rel=1e-12)
    assert all_reduce_time(16 * MIB, eight) == pytest.approx(200e-6, rel=1e-12)
    # Outside: the alpha-beta line through the first and last measured points.
    bandwidth = (64 - 1) * MIB / (700e-6 - 50e-6)
    latency = 50e-6 - MIB / bandwidth
    assert all_reduce_time(256 * MIB, eight) == pytest.approx(latency + 256 * MIB / bandwidth, rel=1e-12)
    assert all_reduce_time(4096, eight) == pytest.approx(latency + 4096 / bandwidth, rel=1e-12)
    # The profile names an all-gather by each rank's shard, a reduce-scatter by its input.
    assert all_gather_time(8 * 4 * MIB, eight) == pytest.approx(math.sqrt(40e-6 * 400e-6), rel=1e-12)
    assert reduce_scatter_time(8 * MIB, eight) == pytest.approx(90e-6, rel=1e-12)
    # A group size that was not measured keeps the alpha-beta formulas of the catalog links.
    plain = topology_of(parse_cluster("1x8xH100-SXM"))
    assert all_reduce_time(4 * MIB, four) == all_reduce_time(4 * MIB, plain.group_link([0, 1, 2, 3]))
    # Send/recv between two ranks of the node (measured between ranks 0 and 1, whatever the process count).
    from fivefold.cost.comm import p2p_time

    assert p2p_time(8 * MIB, topology.pair_link(0, 5)) == pytest.approx(
        math.exp(math.log(20e-6) + 0.5 * (math.log(500e-6) - math.log(20e-6))), rel=1e-12)


def test_groups_across_nodes_keep_the_formulas():
    two_nodes = calibrated("2x8xH100-SXM")
    plain = parse_cluster("2x8xH100-SXM")
    across = topology_of(two_nodes).group_link([0, 8])
    assert across.measured is None
    assert all_reduce_time(64 * MIB, across) == all_reduce_time(64 * MIB, topology_of(plain).group_link([0, 8]))


def _plan(cluster: ClusterSpec, **layout) -> Plan:
    return Plan(model=PRESETS["llama3-8b"], cluster=cluster, train=TrainSpec(seq_len=4096, global_batch=16),
                **layout)


def test_slower_measured_gemms_make_a_slower_estimate():
    catalog = parse_cluster("1x8xH100-SXM")
    # The catalog's large-GEMM rate on H100 is 0.68 x 989 TFLOP/s = 673 TFLOP/s; measure half of that.
    slow = [(n, n, n, "bf16", 0.34 * 989.4e12) for n in (1024, 4096, 8192)]
    fast = [(n, n, n, "bf16", 0.9 * 989.4e12) for n in (1024, 4096, 8192)]
    base = estimate(_plan(catalog, dp=8, zero=1))
    slower = estimate(_plan(calibrated("1x8xH100-SXM", gemm=slow, collectives=()), dp=8, zero=1))
    faster = estimate(_plan(calibrated("1x8xH100-SXM", gemm=fast, collectives=()), dp=8, zero=1))
    assert slower.step_time_s > 1.4 * base.step_time_s
    assert faster.step_time_s < base.step_time_s
    assert slower.mfu < base.mfu < faster.mfu


def test_slower_measured_collectives_expose_more_data_parallel_time():
    catalog = parse_cluster("1x8xH100-SXM")
    plan = _plan(catalog, dp=8, zero=3)
    base = estimate(plan)
    # 8-rank all-gathers and reduce-scatters at 20 GB/s instead of NVLink's ~360 GB/s bus bandwidth.
    slow = tuple((kind, 8, size, 50e-6 + (size * 8 if kind == "all_gather" else size) * 7 / 8 / 20e9)
                 for kind in ("all_gather", "reduce_scatter") for size in (MIB, 64 * MIB))
    measured = estimate(_plan(calibrated("1x8xH100-SXM", gemm=(), collectives=slow), dp=8, zero=3))
    assert measured.dp_comm_s > 10 * base.dp_comm_s
    assert measured.dp_comm_exposed_s > base.dp_comm_exposed_s
    assert measured.step_time_s > base.step_time_s
    # The per-layer compute is untouched (no GEMM points): the same stage compute.
    assert measured.stage_costs[0].forward == pytest.approx(base.stage_costs[0].forward)
