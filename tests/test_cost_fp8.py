"""FP8 training (--dtype fp8): FP8 GEMMs with BF16 elsewhere, casts, FP8 all-gather, MFU against BF16."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fivefold.cost import STACKS, estimate
from fivefold.errors import SpecError
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

EIGHT_GPUS = parse_cluster("1x8xH100-96GB")


def _plan(dtype: str, cluster=EIGHT_GPUS, **fields: object) -> Plan:
    model = replace(PRESETS["llama3-8b"], max_seq_len=8192)
    return Plan(model=model, cluster=cluster, train=TrainSpec(seq_len=8192, global_batch=16, dtype=dtype), dp=8,
                zero=3, micro_batch=2, recompute="selective", **fields)


def test_a100_refuses_fp8_with_one_line() -> None:
    with pytest.raises(SpecError) as caught:
        estimate(_plan("fp8", parse_cluster("1x8xA100-80GB")))
    assert caught.value.field == "train.dtype" and "no FP8 tensor cores" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_fp8_speedup_matches_torchtitan_float8() -> None:
    """TorchTitan's Table 1 (8 x H100, Llama 3.1 8B, compiled): Float8 6,667 -> 8,532 tokens/s/GPU (1.28x)."""
    stack = STACKS["torchtitan"]
    bf16, fp8 = estimate(_plan("bf16"), stack), estimate(_plan("fp8"), stack)
    # Predicted 1.17x: FP8 GEMMs at ~1.5x the BF16 rate on this 500 W part, attention and the rest in BF16.
    assert fp8.tokens_per_s / bf16.tokens_per_s == pytest.approx(8532 / 6667, rel=0.10)
    # MFU counts model FLOPs against the BF16 peak, and says so.
    assert fp8.mfu / bf16.mfu == pytest.approx(fp8.tokens_per_s / bf16.tokens_per_s)
    assert fp8.mfu_basis == "BF16 peak (GEMMs in FP8)" and bf16.mfu_basis == ""


def test_fp8_casts_cost_time_and_the_all_gather_moves_one_byte() -> None:
    stack = STACKS["torchtitan"]
    no_gather = replace(stack, features=replace(stack.features, fp8_all_gather=False))
    cluster = parse_cluster("16x8xH100-96GB")
    plan = Plan(model=_plan("fp8").model, cluster=cluster, train=TrainSpec(seq_len=8192, global_batch=256, dtype="fp8"),
                dp=128, zero=3, micro_batch=2, recompute="selective")
    with_gather, without = estimate(plan, stack), estimate(plan, no_gather)
    assert with_gather.dp_comm_s < 0.8 * without.dp_comm_s  # weights gathered in 1 byte, not 2 (fp32 reduce as before)
    assert with_gather.breakdown_s["compute"] < without.breakdown_s["compute"]  # no per-micro-batch weight cast
    # Eager casts (amax, then cast) move more than compiled ones, where the amax fuses into the producer.
    eager = estimate(plan, replace(stack, fused_elementwise=False))
    assert eager.step_time_s > with_gather.step_time_s


def test_fp8_weight_copies_take_memory() -> None:
    stack = STACKS["torchtitan"]
    no_gather = replace(stack, features=replace(stack.features, fp8_all_gather=False))
    layer = PRESETS["llama3-8b"].params_per_layer()
    # Gathered in bf16 (this layer and the next, 2 bytes each), the computing layer adds its FP8 copy and
    # transpose; gathered already in FP8 (torchao's all-gather) the two layers take 1 byte each, plus a transpose.
    bf16, fp8 = estimate(_plan("bf16"), no_gather).memory, estimate(_plan("fp8"), no_gather).memory
    assert fp8.transient - bf16.transient == pytest.approx(2 * layer, rel=1e-6)
    bf16, fp8 = estimate(_plan("bf16"), stack).memory, estimate(_plan("fp8"), stack).memory
    assert fp8.transient - bf16.transient == pytest.approx(-layer, rel=1e-6)


def test_optimizer_temporaries_set_the_peak_when_activations_are_small() -> None:
    """torch's foreach AdamW allocates one fp32 list the size of the optimizer shard after backward freed the
    activations: with ZeRO-0 replicas of a model whose activations are tiny, that is the peak."""
    model = replace(PRESETS["llama3-8b"], max_seq_len=128)
    plan = Plan(model=model, cluster=parse_cluster("1x2xH100-96GB"), train=TrainSpec(seq_len=128, global_batch=2),
                dp=2, zero=0, recompute="full")
    fused, foreach = STACKS["modern"], replace(STACKS["torchtitan"], allocator_slack=0.0)
    memory = estimate(plan, foreach).memory
    assert memory.transient == pytest.approx(4 * model.num_params(), rel=0.01)
    assert estimate(plan, fused).memory.transient < 0.1 * memory.transient
