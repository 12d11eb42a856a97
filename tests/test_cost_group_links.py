"""Every group of every dimension is costed on the links its ranks really use (issue 17)."""

from __future__ import annotations

from dataclasses import replace

from fivefold.cost import STACKS, Layout, estimate
from fivefold.cost.comm import all_reduce_time, topology_of
from fivefold.cost.layout import rank_envs
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

CLUSTER = parse_cluster("96x8xA100-80GB")
TRAIN = TrainSpec(seq_len=2048, global_batch=1536)


def _plan(tp: int, **fields: object) -> Plan:
    return Plan(model=PRESETS["gpt3-175b"], cluster=CLUSTER, train=TRAIN, tp=tp, pp=8, dp=768 // (8 * tp),
                micro_batch=1, recompute="selective", zero=1, **fields)


def test_tp6_groups_that_span_two_nodes_ride_the_nic() -> None:
    envs = rank_envs(Layout.of_plan(_plan(6)), topology_of(CLUSTER))
    # Ranks 0-5 sit in node 0, but ranks 6-11 span nodes 0 and 1: the slower group sets the TP time.
    assert envs[0].tp.nodes == 2 and envs[0].tp.members_per_node == 2
    assert rank_envs(Layout.of_plan(_plan(8)), topology_of(CLUSTER))[0].tp.nodes == 1
    stack = STACKS["megatron-lm-2022"]
    tp6, tp8 = estimate(_plan(6), stack), estimate(_plan(8), stack)
    assert tp6.breakdown_s["tp_comm"] > 3 * tp8.breakdown_s["tp_comm"]


def test_data_parallel_groups_of_every_tp_rank_are_checked() -> None:
    # tp6 on 8-GPU nodes: the replicas of tp rank 0 (ranks 0, 6, 12, ...) and of tp rank 1 spread over the
    # nodes differently; the slowest of the six groups is the one costed.
    layout = Layout.of_plan(_plan(6))
    topology = topology_of(CLUSTER)
    env = rank_envs(layout, topology)[0]
    each = [topology.group_link([layout.rank_of(dp=i, tp=t) for i in range(layout.dp)]) for t in range(6)]
    assert env.replicas.size == 16
    assert all_reduce_time(2**26, env.replicas) == max(all_reduce_time(2**26, link) for link in each)


def test_tp_comm_overlap_needs_the_tp_group_inside_one_node() -> None:
    # Userbuffers (Megatron-Core + TE) and async TP (SymmetricMemory) pipeline TP collectives through peer
    # memory over NVLink: a tp16 group on 8-GPU nodes runs plain collectives, mostly exposed, while tp8
    # inside a node hides all but one ring step.
    overlapped, plain = STACKS["megatron-core"], replace(STACKS["megatron-core"], overlap_tp_comm=False)
    tp8 = estimate(_plan(8), overlapped).breakdown_s["tp_comm"]
    assert tp8 < 0.5 * estimate(_plan(8), plain).breakdown_s["tp_comm"]
    assert estimate(_plan(16), overlapped).breakdown_s["tp_comm"] == estimate(_plan(16), plain).breakdown_s["tp_comm"]
    assert estimate(_plan(16), overlapped).breakdown_s["tp_comm"] > 3 * tp8
