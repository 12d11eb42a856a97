"""Each MoE term of the cost model (cost/moe_block.py) against its hand formula, and the terms in
`estimate`'s breakdown and memory (issue 25)."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest

from fivefold.cost import estimate, stack_named
from fivefold.cost.comm import all_to_all_time, topology_of
from fivefold.cost.compute import elementwise_time, gemm_time
from fivefold.cost.layout import Layout, layer_costs, rank_envs
from fivefold.cost.moe_block import HOST_SYNC_SECONDS, KERNELS_AFTER_SYNC
from fivefold.cost.moe_experts import active_experts, grouped_gemm_time
from fivefold.cost.compute import Device
from fivefold.cost.stack import with_expert_gemm
from fivefold.spec.devices import device_named
from fivefold.cost.moe_breakdown import moe_layer_terms
from fivefold.spec import PRESETS, ModelSpec, Plan, TrainSpec, parse_cluster

ROOT = Path(__file__).resolve().parents[1]
# Development data in shared/ beside the repository (where CI puts it too).
MEASURED = next((folder / "h200_grouped.csv" for folder in (ROOT.parent / "shared" / "reference" / "measured",
                                                          Path("/work/shared/reference/measured"))
                 if (folder / "h200_grouped.csv").is_file()), ROOT.parent / "shared" / "h200_grouped.csv")
QWEN = PRESETS["qwen3-30b-a3b"]
STACK = stack_named("megatron-core")


def _plan(model: ModelSpec = QWEN, imbalance: float = 1.0, **fields) -> Plan:
    train = TrainSpec(seq_len=4096, global_batch=64, expert_imbalance=imbalance)
    return Plan(model=model, cluster=parse_cluster("2x8xH100-SXM"), train=train, **{"dp": 16, "ep": 8, **fields})


def _terms(plan: Plan, stack=STACK):
    layout = Layout.of_plan(plan)
    env = rank_envs(layout, topology_of(layout.cluster))[0]
    return moe_layer_terms(layout, env, stack), env


def test_router_permute_sync_and_all_to_all_match_hand_formulas():
    plan = _plan(imbalance=1.5)
    terms, env = _terms(plan)
    device, m, e = env.device, QWEN, 2
    tokens, h, experts, k = 4096, m.hidden, m.experts, m.top_k
    router_gemms = gemm_time(device, tokens, experts, h) + gemm_time(device, tokens, h, experts) + \
        gemm_time(device, h, experts, tokens)
    probabilities = tokens * experts * 4.0  # fp32 softmax over the logits
    aux = 2 * probabilities  # qwen3 trains with an auxiliary loss
    forward = 2 * probabilities + tokens * e * experts + probabilities + tokens * k * 12 + aux
    router = router_gemms + elementwise_time(device, forward, 3) + elementwise_time(device, 3 * probabilities + aux, 2)
    assert terms.router == pytest.approx(router, rel=1e-9)
    routed = tokens * k
    busiest = round(routed * 8 / experts * 1.5) * (experts // 8)  # the busiest rank gets 1.5x the mean
    moved = (4 * routed + 4 * busiest) * h * e
    assert terms.permute == pytest.approx(2 * elementwise_time(device, moved, 4), rel=1e-9)
    assert terms.host_sync == pytest.approx(HOST_SYNC_SECONDS + KERNELS_AFTER_SYNC * STACK.host_seconds_per_kernel)
    dispatch = all_to_all_time(routed * h * e * 1.5, env.ep)
    assert terms.all_to_all == pytest.approx(all_to_all_time(experts * 8.0, env.ep) + 4 * dispatch, rel=1e-9)
    assert terms.shared_experts == 0.0
    # A dispatcher that needs no counts on the host (e.g. padded, fixed-capacity dispatch) pays no sync.
    assert _terms(plan, dataclasses.replace(STACK, moe_dispatch_syncs_host=False))[0].host_sync == 0.0


def test_expert_gemms_run_at_the_grouped_efficiency_of_the_tokens_each_expert_gets():
    terms, env = _terms(_plan())
    device, m = env.device, QWEN
    rows, local, f, h = 4096 * 8 * 8 // 128, 16, m.expert_ffn_hidden, m.hidden  # 2048 rows for each local expert

    def grouped(launches: int, batch: int) -> float:  # `launches` GEMM launches of `batch` experts side by side
        up = [gemm_time(device, rows, 2 * f, h, batch), gemm_time(device, rows, h, 2 * f, batch),
              gemm_time(device, h, 2 * f, rows, batch)]
        down = [gemm_time(device, rows, h, f, batch), gemm_time(device, rows, f, h, batch),
                gemm_time(device, f, h, rows, batch)]
        act = elementwise_time(device, batch * rows * f * 3 * 2) + elementwise_time(device, batch * rows * f * 5 * 2)
        return launches * (sum(up) + sum(down) + act)

    # Megatron-Core's experts run through Transformer Engine's GroupedLinear: a cuBLAS GEMM per expert on 4 streams.
    assert STACK.grouped_gemm_streams == 4
    assert terms.experts == pytest.approx(grouped(4, 4), rel=1e-9)
    one_launch = _terms(_plan(), dataclasses.replace(STACK, grouped_gemm_streams=0))[0]
    assert one_launch.experts == pytest.approx(grouped(1, local), rel=1e-9)
    assert one_launch.experts < terms.experts
    # The same expert FLOPs cut finer (4x the experts, 1/4 the width, 4x top-k) run at a lower rate.
    fine = dataclasses.replace(QWEN, experts=512, top_k=32, expert_ffn_hidden=192)
    assert _terms(_plan(fine))[0].experts > 1.2 * terms.experts  # (the down GEMM's K: 768 -> 192)


def test_fivefold_stack_prices_a_gemm_per_expert_as_its_python_loop_runs_them():
    """models/moe.py GroupedExperts' loop (off sm90+ GPUs, or --expert-gemm loop): for each local expert,
    chunk @ w1.T, chunk @ w3.T, the SwiGLU product and @ w2.T on that expert's rows, one expert after the other on
    one stream."""
    fivefold = with_expert_gemm(stack_named("fivefold"), "loop")
    assert (fivefold.grouped_gemm_streams, fivefold.expert_gate_separate) == (1, True)
    terms, env = _terms(_plan(), fivefold)
    device, f, h = env.device, QWEN.expert_ffn_hidden, QWEN.hidden
    rows, local = 4096 * 8 * 8 // 128, 16  # 2048 rows for each of the 16 local experts
    gate = gemm_time(device, rows, f, h) + gemm_time(device, rows, h, f) + gemm_time(device, h, f, rows)
    down = gemm_time(device, rows, h, f) + gemm_time(device, rows, f, h) + gemm_time(device, f, h, rows)
    product = elementwise_time(device, rows * f * 3 * 2) + elementwise_time(device, rows * f * 5 * 2)
    assert terms.experts == pytest.approx(local * (2 * gate + product + down), rel=1e-9)
    # One launch per expert costs more than one grouped launch of the same rows (fewer tiles per wave).
    grouped = _terms(_plan(), dataclasses.replace(fivefold, grouped_gemm_streams=0, expert_gate_separate=False))[0]
    assert terms.experts > 1.05 * grouped.experts
    # An odd stream count: full groups of 3 experts side by side, then the last expert alone.
    three = _terms(_plan(), dataclasses.replace(fivefold, grouped_gemm_streams=3, expert_gate_separate=False))[0]
    batch = [gemm_time(device, rows, 2 * f, h, b) + gemm_time(device, rows, h, 2 * f, b)
             + gemm_time(device, h, 2 * f, rows, b) + gemm_time(device, rows, h, f, b) + gemm_time(device, rows, f, h, b)
             + gemm_time(device, f, h, rows, b) + elementwise_time(device, b * rows * f * 6)
             + elementwise_time(device, b * rows * f * 10) for b in (3, 1)]
    assert three.experts == pytest.approx(5 * batch[0] + batch[1], rel=1e-9)


def test_fivefold_stack_prices_grouped_mm_on_hopper_and_the_loop_on_a100():
    """On sm90+ GPUs models/moe.py runs three torch._grouped_mm (gate, up, down), each forward, dgrad and wgrad a
    grouped GEMM priced by grouped_gemm_time; an A100 runs the loop."""
    fivefold = stack_named("fivefold")
    terms, env = _terms(_plan(), fivefold)
    device, f, h = env.device, QWEN.expert_ffn_hidden, QWEN.hidden
    rows, local = 4096 * 8 * 8 // 128, 16

    def linear(k, n):
        return (grouped_gemm_time(device, rows, n, k, local) + grouped_gemm_time(device, rows, k, n, local)
                + grouped_gemm_time(device, rows, n, k, local, row_tiles=False))

    product = elementwise_time(device, local * rows * f * 3 * 2) + elementwise_time(device, local * rows * f * 5 * 2)
    assert terms.experts == pytest.approx(2 * linear(h, f) + product + linear(f, h), rel=1e-9)
    loop = _terms(_plan(), with_expert_gemm(fivefold, "loop"))[0]
    assert loop.experts > terms.experts
    a100 = _plan().replace(cluster=parse_cluster("2x8xA100-80GB"))
    assert _terms(a100, fivefold)[0].experts == pytest.approx(_terms(a100, with_expert_gemm(fivefold, "loop"))[0].experts)


@pytest.mark.skipif(not MEASURED.is_file(), reason="shared/reference/measured is not beside the repository")
def test_grouped_gemm_time_reproduces_the_measured_h200_grouped_gemms():
    """reference/measured/h200_grouped.csv: one torch._grouped_mm of x[E*T, hidden] by w[E, hidden, 2*ffn], H200,
    torch 2.11; every grouped_mm row within 15% (fitted: within 10%, mean 6%)."""
    device = Device(device_named("H200"), "bf16")
    rows = [r for r in csv.DictReader(MEASURED.open()) if r["kind"] == "grouped_mm"]
    assert len(rows) == 16
    errors = []
    for row in rows:
        experts, hidden, ffn, tokens = (int(row[k]) for k in ("experts", "hidden", "ffn", "tokens_per_expert"))
        predicted = grouped_gemm_time(device, tokens, 2 * ffn, hidden, experts)
        errors.append(abs(predicted - float(row["seconds"])) / float(row["seconds"]))
    assert max(errors) < 0.15 and sum(errors) / len(errors) < 0.07, errors


def test_a_skewed_router_crowds_rows_onto_fewer_experts():
    """TrainSpec.expert_load: with the busiest expert at 8x the mean (64 experts, top-8: every token through one
    expert) the rows crowd onto 8 experts; the grouped GEMMs then read 8 experts' weights, not 64."""
    assert active_experts(64, 8.0) == 8 and active_experts(64, 1.0) == 64 and active_experts(4, 100.0) == 1
    model = dataclasses.replace(QWEN, experts=64, top_k=8, expert_ffn_hidden=768, hidden=2048)
    few_tokens = dict(dp=1, ep=1, micro_batch=1)
    plan = Plan(model=model, cluster=parse_cluster("1x1xH200"), train=TrainSpec(seq_len=256, global_batch=8),
                **few_tokens)
    skewed = plan.replace(train=dataclasses.replace(plan.train, expert_load=8.0))
    balanced_terms, env = _terms(plan, stack_named("fivefold"))
    skewed_terms = _terms(skewed, stack_named("fivefold"))[0]
    # 256 tokens x 8 copies over 64 experts: 32 rows each, bound by reading every expert's weights
    assert skewed_terms.experts < 0.5 * balanced_terms.experts


def test_shared_experts_are_a_dense_mlp_on_every_token():
    model = dataclasses.replace(QWEN, shared_experts=1)
    terms, env = _terms(_plan(model))
    device, f, h = env.device, QWEN.expert_ffn_hidden, QWEN.hidden
    linear = sum(gemm_time(env.device, *shape) for shape in ((4096, 2 * f, h), (4096, h, 2 * f), (h, 2 * f, 4096),
                                                              (4096, h, f), (4096, f, h), (f, h, 4096)))
    act = elementwise_time(device, 4096 * f * 6) + elementwise_time(device, 4096 * f * 10)
    assert terms.shared_experts == pytest.approx(linear + act, rel=1e-9)


def test_breakdown_names_every_moe_term_and_still_sums_to_the_step():
    result = estimate(_plan(imbalance=1.3), STACK)
    parts = result.breakdown_s
    for key in ("moe_router", "moe_permute", "moe_experts", "moe_host_sync", "ep_comm"):
        assert parts[key] > 0, key
    assert sum(parts.values()) == pytest.approx(result.step_time_s, rel=1e-9)
    # 48 MoE layers x 4 micro-batches on the one pipeline rank, per layer as moe_layer_terms gives.
    terms = _terms(_plan(imbalance=1.3))[0]
    assert parts["moe_experts"] == pytest.approx(48 * 4 * terms.experts, rel=1e-9)
    # The sync's round trip, and the CPU run-ahead it costs: the layer less the same layer with a sync-free dispatch.
    layout = Layout.of_plan(_plan(imbalance=1.3))
    env = rank_envs(layout, topology_of(layout.cluster))[0]
    synced = layer_costs(layout, env, STACK).layer
    free = layer_costs(layout, env, dataclasses.replace(STACK, moe_dispatch_syncs_host=False)).layer
    assert parts["moe_host_sync"] == pytest.approx(48 * 4 * (synced.forward - free.forward), rel=1e-9)
    assert parts["moe_host_sync"] >= 48 * 4 * terms.host_sync
    dense = estimate(_plan(PRESETS["llama3-8b"], ep=1), STACK)
    assert not any(key.startswith("moe_") for key in dense.breakdown_s)


def test_dispatched_token_memory_grows_with_the_busiest_ranks_load():
    balanced, skewed = (estimate(_plan(imbalance=x), STACK).memory for x in (1.0, 1.5))
    # No recompute: the received rows (h) and the three SwiGLU expert tensors per routed copy, 48 layers, 1 in flight.
    per_copy = 2 * (QWEN.hidden + 3 * QWEN.expert_ffn_hidden)
    assert balanced.moe_dispatched == pytest.approx(48 * 4096 * 8 * per_copy, rel=1e-6)
    assert skewed.moe_dispatched == pytest.approx(1.5 * balanced.moe_dispatched, rel=1e-3)
    assert skewed.activations - balanced.activations == pytest.approx(
        skewed.moe_dispatched - balanced.moe_dispatched, rel=0.05)


def test_per_node_dispatch_sends_one_network_copy_per_destination_node() -> None:
    from fivefold.cost.moe_block import dispatch_time

    cluster = parse_cluster("4x8xH100-SXM")
    plan = Plan(model=QWEN, cluster=cluster, train=TrainSpec(seq_len=4096, global_batch=64), dp=32, ep=32)
    layout = Layout.of_plan(plan)
    link = rank_envs(layout, topology_of(cluster))[0].ep
    assert link.nodes == 4 and link.size == 32
    copies = 4096 * 8 * QWEN.hidden * 2
    # top-8 experts over 4 nodes: 4 (1 - (3/4)^8) = 3.60 distinct nodes, 3/4 of them remote = 2.70 network
    # copies per token instead of 6 (8 x 3/4); NVLink carries every copy once.
    remote = 4 * (1 - 0.75 ** 8) * 0.75
    expected = 31 * link.latency + max(31 / 32 * copies / link.intra_bandwidth,
                                       copies / 8 * remote / link.network_bandwidth)
    assert dispatch_time(4096, QWEN, 2, 1.0, link, True) == pytest.approx(expected, rel=1e-9)
    assert dispatch_time(4096, QWEN, 2, 1.0, link, False) == pytest.approx(all_to_all_time(copies, link))
    assert dispatch_time(4096, QWEN, 2, 1.0, link, True) < 0.6 * dispatch_time(4096, QWEN, 2, 1.0, link, False)
