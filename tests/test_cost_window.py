"""head_dim apart from hidden/heads, and sliding-window layers, in FLOPs, time and the attention roofline."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fivefold.cost import estimate
from fivefold.cost.compute import Device, flash_attention_time
from fivefold.cost.flops import attended_keys, attention_flops_per_token, linear_flops_per_token
from fivefold.spec import ModelSpec, Plan, TrainSpec, parse_cluster
from fivefold.spec.devices import device_named

# Qwen3-8B-like attention: 32 heads of 128 on hidden 4096 -> q width 4096; Qwen3-0.6B: 16 x 128 on 1024.
WIDE = ModelSpec(name="wide-heads", layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn_hidden=3072,
                 vocab=32000, max_seq_len=32768)


def test_head_dim_sets_the_projection_flops() -> None:
    h, q, kv = 1024, 16 * 128, 8 * 128
    matrices = h * q + 2 * h * kv + q * h + 3 * h * 3072
    assert linear_flops_per_token(WIDE) == 2 * matrices
    assert attention_flops_per_token(WIDE, 4096) == 4 * 4096 * q
    assert WIDE.params_per_layer() == matrices + 2 * h  # the spec's own count agrees


def test_head_dim_makes_attention_and_projections_slower() -> None:
    narrow = replace(WIDE, head_dim=64)  # = hidden / heads
    cluster, train = parse_cluster("1x8xH100-SXM"), TrainSpec(seq_len=4096, global_batch=8)
    wide_time = estimate(Plan(model=WIDE, cluster=cluster, train=train, dp=8)).step_time_s
    narrow_time = estimate(Plan(model=narrow, cluster=cluster, train=train, dp=8)).step_time_s
    from fivefold.cost import model_flops_per_step

    flops_ratio = model_flops_per_step(WIDE, train) / model_flops_per_step(narrow, train)
    assert flops_ratio == pytest.approx(1.40, abs=0.01)
    assert 1.15 < wide_time / narrow_time < flops_ratio  # fixed costs (vocab head, norms) dilute it


def test_sliding_window_layers_count_their_band() -> None:
    oss = replace(WIDE, layers=36, sliding_window=128, full_attention_every=2)  # GPT-OSS: alternating
    assert oss.sliding_layers == 18 and oss.is_sliding_layer(0) and not oss.is_sliding_layer(1)
    assert attended_keys(oss, 8192) == (128 + 8192) / 2
    assert attention_flops_per_token(oss, 8192) == pytest.approx(attention_flops_per_token(WIDE, 8192) * 4160 / 8192)
    every = replace(WIDE, sliding_window=1024)  # every layer slides
    assert attended_keys(every, 512) == 512  # a window longer than the sequence is full attention


def test_flash_attention_time_follows_the_band() -> None:
    device = Device(device_named("H100-SXM"), "bf16")
    full = flash_attention_time(device, 32, 32768, 32768, 128, True, False)
    band = flash_attention_time(device, 32, 32768, 32768, 128, True, False, window=4096)
    # Causal full attention does ~s/2 keys per query; the band ~w - w^2/(2s) plus the edge blocks.
    assert band / full == pytest.approx((4096 * (1 - 4096 / 65536) + 128) / (32768 / 2), rel=0.02)
    # A tiny window leaves the kernel reading Q, K, V (the roofline's memory term), not computing.
    tiny = flash_attention_time(device, 32, 32768, 32768, 128, True, False, window=16)
    assert tiny >= 4.0 * 32 * (32768 + 16 + 128) * 128 * 2 / device.bandwidth


def test_sliding_window_shortens_a_long_sequence_step() -> None:
    cluster, train = parse_cluster("1x8xH100-SXM"), TrainSpec(seq_len=32768, global_batch=8)
    full = estimate(Plan(model=WIDE, cluster=cluster, train=train, dp=8, recompute="full"))
    slide = estimate(Plan(model=replace(WIDE, sliding_window=4096), cluster=cluster, train=train, dp=8,
                          recompute="full"))
    assert slide.step_time_s < 0.5 * full.step_time_s
    assert slide.memory.total == pytest.approx(full.memory.total)  # fused attention stores no scores
