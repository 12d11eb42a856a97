"""The MoE block's host side and expert folding under Megatron-Core (issue 25), against hand formulas: the CPU
run-ahead lost at the host sync on token counts, Transformer Engine's FP8 GroupedLinear host work per expert, and
the etp gather after the dispatch (not before routing)."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.cost import stack_named
from fivefold.cost.comm import all_gather_time, all_to_all_time, reduce_scatter_time, topology_of
from fivefold.cost.compute import Device
from fivefold.cost.layout import Layout, rank_envs
from fivefold.cost.moe_block import (TE_FP8_HOST_OPS_PER_EXPERT, TE_FP8_PADDING_PASSES, etp_exchange, moe_mlp,
                                     moe_tokens)
from fivefold.cost.passwork import PassWork
from fivefold.cost.stack import SoftwareStack
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster
from fivefold.spec.devices import CATALOG

QWEN = PRESETS["qwen3-30b-a3b"]
STACK = stack_named("megatron-core")


def _work(gpu_a: float, kernels_a: int, gpu_b: float, kernels_b: int) -> PassWork:
    work = PassWork()
    work.forward, work.forward_kernels = gpu_a, kernels_a
    work.host_sync()
    work.forward += gpu_b
    work.forward_kernels += kernels_b
    return work


@pytest.mark.parametrize("gpu_a, kernels_a, gpu_b, kernels_b", [
    (600e-6, 20, 1.2e-3, 150),  # attention GPU-bound, MoE block launch-bound: C_B + G_A
    (100e-6, 20, 3.0e-3, 150),  # both GPU-bound: the GPU time, as without a sync
    (600e-6, 100, 1.2e-3, 150),  # both launch-bound: the CPU time, as without a sync
])
def test_a_host_sync_splits_the_forward_into_two_segments_the_cpu_cannot_run_ahead_across(
        gpu_a: float, kernels_a: int, gpu_b: float, kernels_b: int) -> None:
    stack = SoftwareStack(host_seconds_per_kernel=10e-6)
    host_a, host_b = kernels_a * 10e-6, kernels_b * 10e-6
    forward = _work(gpu_a, kernels_a, gpu_b, kernels_b).finish(stack, "none").forward
    assert forward == pytest.approx(max(host_b + max(host_a, gpu_a), gpu_a + gpu_b), rel=1e-12)
    unsynced = PassWork()
    unsynced.forward, unsynced.forward_kernels = gpu_a + gpu_b, kernels_a + kernels_b
    assert unsynced.finish(stack, "none").forward == pytest.approx(max(host_a + host_b, gpu_a + gpu_b), rel=1e-12)
    # Full recompute repeats the forward, sync included.
    assert _work(gpu_a, kernels_a, gpu_b, kernels_b).finish(stack, "full").recompute == pytest.approx(forward)


def test_te_fp8_grouped_linear_adds_its_per_expert_host_work() -> None:
    h100 = CATALOG["H100-SXM"]
    split = moe_tokens(4096, 1, 1, False, False)
    link = rank_envs(layout := Layout.of_plan(Plan(model=QWEN, cluster=parse_cluster("2x8xH100-SXM"),
                                                   train=TrainSpec(seq_len=4096, global_batch=64), dp=16, ep=8)),
                     topology_of(layout.cluster))[0].ep
    counts = {}
    for dtype in ("bf16", "fp8"):
        work = PassWork()
        moe_mlp(work, QWEN, split, 8, 1.0, Device(h100, dtype), STACK, link)
        counts[dtype] = (work.forward_kernels, work.backward_kernels)
    local = QWEN.experts // 8
    assert counts["fp8"][0] - counts["bf16"][0] == TE_FP8_HOST_OPS_PER_EXPERT[0] * local
    assert counts["fp8"][1] - counts["bf16"][1] == TE_FP8_HOST_OPS_PER_EXPERT[1] * local
    # A stack with one grouped launch (no TransformerEngine GroupedLinear) has no such per-expert host work.
    single = dataclasses.replace(STACK, grouped_gemm_streams=0)
    work = PassWork()
    moe_mlp(work, QWEN, split, 8, 1.0, Device(h100, "fp8"), single, link)
    assert work.forward_kernels == counts["bf16"][0]


def test_te_fp8_grouped_linear_pads_the_dispatched_rows_and_unpads_the_output(monkeypatch) -> None:
    """Fp8Padding / Fp8Unpadding around TE's FP8 GroupedLinear: 4 row copies of hidden elements each way, in
    the experts term; none in BF16 or for one grouped launch."""
    from fivefold.cost import moe_block

    h100 = CATALOG["H100-SXM"]
    split = moe_tokens(4096, 1, 1, False, False)
    link = rank_envs(layout := Layout.of_plan(Plan(model=QWEN, cluster=parse_cluster("2x8xH100-SXM"),
                                                   train=TrainSpec(seq_len=4096, global_batch=64), dp=16, ep=8)),
                     topology_of(layout.cluster))[0].ep

    def experts(dtype: str, stack: SoftwareStack = STACK) -> float:
        return moe_mlp(PassWork(), QWEN, split, 8, 1.0, Device(h100, dtype), stack, link).terms.experts

    padded = {dtype: experts(dtype) for dtype in ("bf16", "fp8")}
    single = dataclasses.replace(STACK, grouped_gemm_streams=0)
    single_fp8 = experts("fp8", single)
    monkeypatch.setattr(moe_block, "TE_FP8_PADDING_PASSES", 0)
    bare = {dtype: experts(dtype) for dtype in ("bf16", "fp8")}
    rows = 4096 * QWEN.top_k  # the busiest rank's rows at balance: every copy its 16 local experts get
    bandwidth = Device(h100, "fp8").bandwidth
    assert padded["fp8"] - bare["fp8"] == pytest.approx(2 * TE_FP8_PADDING_PASSES * rows * QWEN.hidden * 2 / bandwidth,
                                                        rel=1e-9)
    assert padded["bf16"] == bare["bf16"] and single_fp8 == experts("fp8", single)


def test_megatron_core_routes_its_own_tokens_and_gathers_the_received_copies_over_etp() -> None:
    # tp2 etp2 ep4 with sequence parallelism on 8 H100: each rank routes its 4096 / 2 tokens (not the etp group's
    # 4096), so the all-to-all carries 2048 x top_k copies; the etp pair all-gathers the received copies after it.
    assert moe_tokens(4096, 2, 2, True, False) == (2048, 2, 2, 1)
    assert moe_tokens(4096, 2, 2, False, False) == (4096, 1, 2, 2)  # no SP: every tp rank routes all tokens
    plan = Plan(model=QWEN, cluster=parse_cluster("1x8xH100-SXM"), train=TrainSpec(seq_len=4096, global_batch=16),
                dp=4, tp=2, ep=4, etp=2, sequence_parallel=True)
    layout = Layout.of_plan(plan)
    env = rank_envs(layout, topology_of(layout.cluster))[0]
    assert env.etp.size == 2 and env.ep.size == 4
    work = PassWork()
    block = moe_mlp(work, QWEN, moe_tokens(4096, 2, 2, True, False), 4, 1.0, env.device, STACK, env.ep)
    copies = 2048 * QWEN.top_k
    dispatch = all_to_all_time(copies * QWEN.hidden * 2, env.ep)
    assert work.forward_comm["ep"] == pytest.approx(all_to_all_time(QWEN.experts * 8.0, env.ep) + 2 * dispatch)
    assert block.expert_rows == copies * 2  # each local expert computes the etp pair's received rows
    etp_exchange(work, QWEN, block, env.etp, 2)
    rows = copies * 2 * QWEN.hidden * 2
    exchange = all_gather_time(rows, env.etp) + reduce_scatter_time(rows, env.etp)
    assert exchange > 0 and work.forward_comm["tp"] == pytest.approx(exchange)


def test_a_profiled_cpu_rank_loses_no_run_ahead_at_the_sync() -> None:
    # A CPU rank with measured host costs computes what it issues: cost/host.py charges its host work in series,
    # so the dispatcher's sync marks no split there (the round trip is still charged).
    from fivefold.spec.cluster import HostCosts

    split = moe_tokens(4096, 1, 1, False, False)
    device = Device(CATALOG["H100-SXM"], "bf16")
    layout = Layout.of_plan(Plan(model=QWEN, cluster=parse_cluster("1x8xH100-SXM"),
                                 train=TrainSpec(seq_len=4096, global_batch=8), dp=8, ep=8))
    link = rank_envs(layout, topology_of(layout.cluster))[0].ep
    for host, marked in ((None, True), (HostCosts(op_forward=5e-6), False)):
        device.host = host
        work = PassWork()
        moe_mlp(work, QWEN, split, 8, 1.0, device, STACK, link)
        assert (work.synced_at is not None) == marked
        assert work.host_wait > 0
