"""Memory: ZeRO model states, Korthikanti activations, in-flight micro-batches, and the invariants."""

import pytest

from fivefold.cost import STACKS
from fivefold.cost import estimate as _estimate
from fivefold.cost.layer import LayerShape
from fivefold.cost.memory import (in_flight_chunks, korthikanti_activation_bytes, layer_activation_bytes,
                                  zero_model_state_bytes)
from fivefold.spec import PRESETS, ModelSpec, Plan, TrainSpec, parse_cluster


# These checks describe the mechanisms of the open-ended `modern` stack; the default became `fivefold` (issue 25).
def estimate(plan, stack=None, headroom: float = 0.0):  # type: ignore[no-untyped-def]
    return _estimate(plan, stack or STACKS["modern"], headroom)


GIB = 2**30


@pytest.mark.parametrize("zero, per_param", [(0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)])
def test_zero_bytes_per_parameter_match_the_paper(zero, per_param):
    # Rajbhandari et al. 2020: Adam + mixed precision, N = 8 data-parallel ranks.
    assert sum(zero_model_state_bytes(1e9, "bf16", zero, 8)) == pytest.approx(per_param * 1e9)


def test_fp32_training_keeps_no_master_copy():
    assert zero_model_state_bytes(1e9, "fp32", 0, 1) == (4e9, 4e9, 8e9)


def test_fsdp2_shards_are_the_fp32_master_weights():
    """FSDP2 (a stack that names its whole-gradient bytes) keeps the fp32 weight as the ZeRO-3 shard and
    reduces gradients in fp32: 4 + 4 + 8 per parameter over N, the paper's 16 / N; with the gradients
    accumulated whole under pp, 12 / N and 4 per parameter."""
    assert zero_model_state_bytes(1e9, "bf16", 3, 8, True, 4) == (4e9 / 8, 4e9 / 8, 8e9 / 8)
    assert zero_model_state_bytes(1e9, "bf16", 3, 8, False, 4) == (4e9 / 8, 4e9, 8e9 / 8)


def test_korthikanti_formulas_by_hand():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    # 5 a s / h = 80 for GPT-3; without SP: 10 + 24/8 + 80/8 = 23 sbh.
    assert korthikanti_activation_bytes(s, b, h, a, t) == pytest.approx(23 * sbh)
    assert korthikanti_activation_bytes(s, b, h, a, t, sequence_parallel=True) == pytest.approx((34 + 80) / 8 * sbh)
    assert korthikanti_activation_bytes(s, b, h, a, t, True, "selective") == pytest.approx(34 / 8 * sbh)
    assert korthikanti_activation_bytes(s, b, h, a, 1) == pytest.approx((34 + 80) * sbh)
    assert korthikanti_activation_bytes(s, b, h, a, t, False, "full") == pytest.approx(2 * sbh)


GPT = ModelSpec(layers=96, hidden=12288, heads=96, mlp="gelu", norm="layernorm", position="learned", vocab=51200,
                max_seq_len=2048)


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_tensor_by_tensor_sum_reduces_to_korthikanti_for_gpt(tp, sequence_parallel, recompute):
    if sequence_parallel and tp == 1:
        return
    shape = LayerShape(GPT, 2048, 2, tp, 1, 1, sequence_parallel, recompute)
    ours = layer_activation_bytes(shape, dropout=True, attention="unfused", element_bytes=2)
    assert ours == pytest.approx(korthikanti_activation_bytes(2048, 2, 12288, 96, tp, sequence_parallel, recompute))


def test_fused_attention_keeps_no_scores_and_gqa_keeps_smaller_kv():
    shape = LayerShape(GPT, 2048, 1, 8, 1, 1, True, "none")
    flash = layer_activation_bytes(shape, True, "flash", 2)
    # The s x s terms vanish; only an fp32 log-sum-exp per query row and head remains.
    assert flash == pytest.approx(korthikanti_activation_bytes(2048, 1, 12288, 96, 8, True, "selective")
                                  + 2048 * 96 * 4 / 8)
    llama = PRESETS["llama3-8b"]
    mha = ModelSpec(**{**llama.to_dict(), "kv_heads": 32})
    gqa_bytes = layer_activation_bytes(LayerShape(llama, 4096, 1, 1, 1, 1, False, "none"), False, "flash", 2)
    mha_bytes = layer_activation_bytes(LayerShape(mha, 4096, 1, 1, 1, 1, False, "none"), False, "flash", 2)
    assert mha_bytes - gqa_bytes == pytest.approx(2 * 2 * 4096 * (4096 - 1024))  # K and V, 2 bytes each


def test_in_flight_micro_batches_per_schedule():
    assert [in_flight_chunks("1f1b", 4, 1, 16, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_chunks("1f1b", 4, 1, 2, 0) == 2  # never more than the step has
    assert in_flight_chunks("gpipe", 4, 1, 16, 3) == 16
    # Interleaved, rank 0: 2(p-1) + (v-1)p + 1 = 11 chunks of half a stage: 5.5 = (1 + (p-1)/(pv)) p.
    assert in_flight_chunks("interleaved-1f1b", 4, 2, 16, 0) / 2 == pytest.approx((1 + 3 / 8) * 4)
    assert in_flight_chunks("zbv", 4, 2, 16, 2) / 2 == 4  # the V shape holds p on every rank
    # ZB-H1 keeps activations until the W pass, which rank r runs r steps late: p on every rank.
    assert [in_flight_chunks("zb-h1", 4, 1, 16, r) for r in range(4)] == [4, 4, 4, 4]
    assert in_flight_chunks("zb-h1", 4, 1, 2, 3) == 2


def _plan(model, cluster, **layout):
    train = TrainSpec(seq_len=layout.pop("seq_len", 4096), global_batch=layout.pop("global_batch", 32), dtype="bf16")
    return Plan(model=model, cluster=parse_cluster(cluster), train=train, **layout)


CASES = [
    (PRESETS["llama3-8b"], "1x8xH100-SXM", dict(tp=2, dp=4, sequence_parallel=True, zero=1)),
    (PRESETS["llama3-70b"], "2x8xH100-SXM", dict(tp=4, pp=4, schedule="interleaved-1f1b", virtual_stages=2,
                                                 sequence_parallel=True, micro_batch=1)),
    (PRESETS["gpt3-175b"], "8x8xA100-80GB", dict(tp=8, pp=8, sequence_parallel=True, seq_len=2048)),
    (PRESETS["mixtral-8x7b"], "2x8xH100-SXM", dict(tp=2, pp=2, dp=4, ep=4, zero=1)),
    (PRESETS["llama3-8b"], "1x8xA100-80GB", dict(cp=2, dp=4, zero=3, seq_len=8192)),
]


@pytest.mark.parametrize("model, cluster, layout", CASES)
def test_more_recompute_never_raises_memory(model, cluster, layout):
    peaks = []
    for recompute in ("none", "selective", "full"):
        result = estimate(_plan(model, cluster, **dict(layout), recompute=recompute))
        peaks.append([m.total for m in result.rank_memory])
    for less, more in zip(peaks, peaks[1:]):
        assert all(b <= a + 1 for a, b in zip(less, more))
    assert sum(peaks[2]) < sum(peaks[0])


def test_1f1b_memory_peaks_on_the_first_stage_and_zero_shrinks_states():
    plan = _plan(PRESETS["llama3-70b"], "4x8xH100-SXM", tp=8, pp=4, micro_batch=1, sequence_parallel=True, zero=1)
    result = estimate(plan)
    activations = [m.activations for m in result.rank_memory]
    assert activations == sorted(activations, reverse=True)
    states = {zero: estimate(plan.replace(zero=zero, layers_per_stage=plan.layers_per_stage)).memory
              for zero in (0, 1, 2, 3)}
    assert states[1].optimizer == pytest.approx(states[0].optimizer / 1)  # dp=1: nothing to shard
    wide = _plan(PRESETS["llama3-8b"], "1x8xH100-SXM", dp=8)
    full = {zero: estimate(wide.replace(zero=zero)).memory for zero in (0, 3)}
    assert full[3].params == pytest.approx(full[0].params / 8)
    assert full[3].optimizer == pytest.approx(full[0].optimizer / 8)
