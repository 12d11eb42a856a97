"""estimate(plan): kernel times, the JSON contract, MFU, recompute, overlap and heterogeneous stages."""

import pytest

from fivefold.cost import STACKS, model_flops_per_step
from fivefold.cost import estimate as _estimate
from fivefold.cost.compute import Device, elementwise_time, gemm_time
from fivefold.cost.layout import Layout, layer_work
from fivefold.spec import CATALOG, PRESETS, Plan, TrainSpec, parse_cluster


# These checks describe the mechanisms of the open-ended `modern` stack; the default became `fivefold` (issue 25).
def estimate(plan, stack=None, headroom: float = 0.0):  # type: ignore[no-untyped-def]
    return _estimate(plan, stack or STACKS["modern"], headroom)


A100 = Device(CATALOG["A100-80GB"], "bf16")


def test_large_gemm_time_by_hand():
    # 8192^3: 2048 tiles of 256x128 in 19 waves on 108 SMs, K / (K + 96) main-loop efficiency, 80% of 312 TF.
    flops = 2 * 8192**3
    efficiency = 0.8 * (2048 / (19 * 108)) * (8192 / (8192 + 96))
    assert gemm_time(A100, 8192, 8192, 8192) == pytest.approx(flops / (312e12 * efficiency) + 4e-6, rel=1e-9)


def test_gemm_efficiency_depends_on_shape_and_obeys_the_roofline():
    def tflops(m, n, k):
        return 2 * m * n * k / gemm_time(A100, m, n, k) / 1e12

    assert tflops(8192, 8192, 8192) > 240
    assert tflops(8192, 384, 8192) < tflops(8192, 8192, 8192)  # a TP-split skinny GEMM wastes SMs
    assert tflops(16384, 16384, 128) < 0.6 * tflops(16384, 16384, 8192)  # short K: memory-bound
    # A matrix-vector product is bound by moving the matrix: time >= bytes / achievable bandwidth.
    assert gemm_time(A100, 1, 8192, 8192) >= 8192 * 8192 * 2 / (2.039e12 * 0.8)
    assert elementwise_time(A100, 1.6e9) == pytest.approx(1.6e9 / (2.039e12 * 0.8) + 4e-6)


def _llama_plan(**layout):
    train = TrainSpec(seq_len=layout.pop("seq_len", 8192), global_batch=layout.pop("global_batch", 32))
    return Plan(model=PRESETS["llama3-8b"], cluster=parse_cluster(layout.pop("cluster", "1x8xH100-SXM")),
                train=train, **layout)


def test_json_contract():
    result = estimate(_llama_plan(tp=2, dp=4, sequence_parallel=True, zero=1)).to_dict()
    for key in ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "bubble_fraction", "fits",
                "memory_gib", "breakdown_s", "stages"):
        assert key in result
    for key in ("peak_per_rank", "params", "grads", "optimizer", "activations"):
        assert result["memory_gib"][key] >= 0
    for key in ("compute", "tp_comm", "dp_comm", "pp_comm", "bubble", "recompute", "optimizer"):
        assert key in result["breakdown_s"]
    assert sum(result["breakdown_s"].values()) == pytest.approx(result["step_time_s"], rel=1e-9)
    assert isinstance(result["fits"], bool)


def test_mfu_and_throughput_by_definition():
    plan = _llama_plan(tp=2, dp=4, sequence_parallel=True, zero=1)
    result = estimate(plan)
    flops = model_flops_per_step(plan.model, plan.train)
    assert result.mfu == pytest.approx(flops / (result.step_time_s * 8 * 989.4e12), rel=1e-12)
    assert result.model_tflops_per_gpu == pytest.approx(flops / result.step_time_s / 8 / 1e12, rel=1e-12)
    assert result.tokens_per_s == pytest.approx(32 * 8192 / result.step_time_s, rel=1e-12)
    assert 0.3 < result.mfu < 0.7  # a sane H100 number for an 8B dense model


def test_recompute_costs_one_forward_of_the_layers():
    plan = _llama_plan(dp=8, zero=1, recompute="none")
    none = estimate(plan)
    full = estimate(plan.replace(recompute="full"))
    layer = layer_work(Layout.of_plan(plan), STACKS["modern"])[0]
    forward = 32 * layer.forward * none.micro_batches  # every layer once more; not the embedding or head
    assert full.breakdown_s["recompute"] > 0 and none.breakdown_s["recompute"] == 0
    assert full.pipeline_s - none.pipeline_s == pytest.approx(forward, rel=1e-9)
    assert full.hardware_tflops_per_gpu > full.model_tflops_per_gpu


def test_gradient_reduction_overlaps_backward_only_when_the_stack_does():
    plan = _llama_plan(dp=8, zero=1, cluster="8x1xH100-SXM", seq_len=2048, global_batch=8)
    overlapped = estimate(plan, STACKS["modern"])
    blocking = estimate(plan, STACKS["megatron-lm-2022"])
    assert overlapped.dp_comm_exposed_s < overlapped.dp_comm_s
    assert blocking.dp_comm_exposed_s == pytest.approx(blocking.dp_comm_s)


def test_slowest_stage_sets_the_pace_on_a_mixed_cluster():
    model, train = PRESETS["llama3-8b"], TrainSpec(seq_len=4096, global_batch=32)
    mixed = Plan(model=model, cluster=parse_cluster("1x8xA100-80GB+1x8xH100-SXM"), train=train, tp=8, pp=2,
                 layers_per_stage=(16, 16))
    fast = Plan(model=model, cluster=parse_cluster("2x8xH100-SXM"), train=train, tp=8, pp=2,
                layers_per_stage=(16, 16))
    a100_stage, h100_stage = estimate(mixed).stage_costs
    assert a100_stage.forward > 1.5 * h100_stage.forward
    assert estimate(mixed).step_time_s > 1.4 * estimate(fast).step_time_s


def test_embedding_and_head_sit_on_the_end_stages():
    plan = Plan(model=PRESETS["llama3-8b"], cluster=parse_cluster("1x4xH100-SXM"),
                train=TrainSpec(seq_len=4096, global_batch=16), pp=4, layers_per_stage=(8, 8, 8, 8))
    first, second, _, last = estimate(plan).stage_costs
    vocab_rows = 128256 * 4096
    assert first.static_bytes - second.static_bytes == pytest.approx(16 * vocab_rows, rel=1e-3)  # 16 B/param
    assert last.forward > second.forward and first.forward > second.forward
    assert last.send_activation == 0 and first.send_activation > 0
