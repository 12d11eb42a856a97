"""Alpha-beta collective costs, and links that follow the placement (NVLink inside a node, NIC across)."""

import pytest

from fivefold.cost import STACKS
from fivefold.cost import estimate as _estimate
from fivefold.cost.comm import (INTRA_EFFICIENCY, NETWORK_EFFICIENCY, GroupLink, all_gather_time, all_reduce_time,
                                all_to_all_time, p2p_time, topology_of)
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster


# These checks describe the mechanisms of the open-ended `modern` stack; the default became `fivefold` (issue 25).
def estimate(plan, stack=None, headroom: float = 0.0):  # type: ignore[no-untyped-def]
    return _estimate(plan, stack or STACKS["modern"], headroom)


H100_NVLINK = 450e9 * INTRA_EFFICIENCY  # achievable bytes/s per GPU
H100_NIC_PER_GPU = 400e9 / 8 * NETWORK_EFFICIENCY  # a DGX H100 node: 3.2 Tb/s = 400 GB/s over 8 GPUs


def test_ring_all_reduce_by_hand():
    link = GroupLink(8, 1, 8, H100_NVLINK, float("inf"), 5e-6)
    # 2 (n-1) alpha + 2 (n-1)/n S / beta for 1 GB over 8 GPUs.
    assert all_reduce_time(1e9, link) == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * 1e9 / H100_NVLINK)
    assert all_gather_time(1e9, link) == pytest.approx(7 * 5e-6 + 7 / 8 * 1e9 / H100_NVLINK)


def test_tree_wins_for_small_messages_on_many_ranks():
    link = GroupLink(64, 8, 8, H100_NVLINK, H100_NIC_PER_GPU, 10e-6)
    ring = 2 * 63 * 10e-6 + 2 * 63 / 64 * 1e3 / link.ring_bandwidth
    tree = 2 * 6 * 10e-6 + 2 * 1e3 / link.ring_bandwidth
    assert all_reduce_time(1e3, link) == pytest.approx(tree) and tree < ring
    # Few ranks, big message: the ring's (n-1)/n bandwidth term wins.
    small = GroupLink(8, 1, 8, H100_NVLINK, float("inf"), 5e-6)
    assert all_reduce_time(1e9, small) == pytest.approx(2 * 7 * 5e-6 + 2 * 7 / 8 * 1e9 / H100_NVLINK)
    assert all_reduce_time(1e9, small) < 2 * 3 * 5e-6 + 2 * 1e9 / H100_NVLINK


def test_group_bandwidth_follows_the_nodes_it_spans():
    topology = topology_of(parse_cluster("4x8xH100-SXM"))
    inside = topology.group_link(list(range(8)))
    assert inside.nodes == 1 and inside.ring_bandwidth == pytest.approx(H100_NVLINK)
    # One member per node (a DP group of tp=8 ranks): every GPU has only its own 1/8 of the node's NIC.
    strided = topology.group_link([0, 8, 16, 24])
    assert strided.ring_bandwidth == pytest.approx(H100_NIC_PER_GPU)
    # All 8 GPUs of each node in one group: one ring per NIC, the whole node NIC (capped by NVLink).
    full = topology.group_link(list(range(32)))
    assert full.ring_bandwidth == pytest.approx(min(8 * H100_NIC_PER_GPU, H100_NVLINK))
    two_per_node = topology.group_link([0, 1, 8, 9, 16, 17, 24, 25])
    assert two_per_node.ring_bandwidth == pytest.approx(2 * H100_NIC_PER_GPU)


def test_point_to_point_and_all_to_all():
    topology = topology_of(parse_cluster("2x8xA100-80GB"))
    near, far = topology.pair_link(0, 1), topology.pair_link(0, 8)
    assert p2p_time(1e8, near) == pytest.approx(5e-6 + 1e8 / (300e9 * INTRA_EFFICIENCY))
    assert p2p_time(1e8, far) == pytest.approx(10e-6 + 1e8 / (200e9 / 8 * NETWORK_EFFICIENCY))
    group = topology.group_link(list(range(16)))
    # 8 of 16 destinations are on the other node: half of each rank's bytes cross its NIC share.
    assert all_to_all_time(1e8, group) == pytest.approx(15 * 10e-6 + 8 / 16 * 1e8 / group.network_bandwidth)


def test_tp_communication_follows_the_placement():
    model, train = PRESETS["llama3-8b"], TrainSpec(seq_len=4096, global_batch=16)
    cluster = parse_cluster("2x8xH100-SXM")
    packed = Plan(model=model, cluster=cluster, train=train, dp=2, tp=8, sequence_parallel=True)
    # Same ranks, but each TP group spread over both nodes: rank r -> device (r % 2) * 8 + r // 2.
    spread = Plan(model=model, cluster=cluster, train=train, dp=2, tp=8, sequence_parallel=True,
                  placement=tuple((r % 2) * 8 + r // 2 for r in range(16)))
    packed_tp = estimate(packed).breakdown_s["tp_comm"]
    spread_tp = estimate(spread).breakdown_s["tp_comm"]
    # 4 members per node: 4 NIC shares (4 x 45 GB/s) instead of NVLink (360 GB/s), plus network latency.
    assert spread_tp > 2 * packed_tp


def test_sequence_parallel_moves_the_same_bytes_as_all_reduce():
    model, train = PRESETS["llama3-70b"], TrainSpec(seq_len=4096, global_batch=8)
    plan = Plan(model=model, cluster=parse_cluster("1x8xH100-SXM"), train=train, tp=8, recompute="full")
    with_sp = estimate(plan.replace(sequence_parallel=True, layers_per_stage=plan.layers_per_stage))
    without = estimate(plan)
    assert with_sp.breakdown_s["tp_comm"] == pytest.approx(without.breakdown_s["tp_comm"], rel=0.02)
    assert with_sp.memory.activations < without.memory.activations
