"""Serving cost terms (cost/serving.py), placement and capacity (cost/deployment.py), the steady state
(cost/serving_estimate.py), the workload spec and `estimate --serve`; the dev-set MAPE (bench/validate_serving.py)."""

import importlib.util
import json
import math
import pathlib
import sys

import pytest

from fivefold.cli import main
from fivefold.cost.deployment import place
from fivefold.cost.serving import ReplicaCost
from fivefold.cost.serving_estimate import estimate_serving
from fivefold.errors import SpecError
from fivefold.spec import PRESETS, device_named, parse_cluster
from fivefold.spec.serve import BatchLimits, ServeLayout, kv_bytes_per_token
from fivefold.spec.workload import Length, Workload, load_trace, parse_length

ROOT = pathlib.Path(__file__).resolve().parent.parent
LLAMA8 = PRESETS["llama3-8b"]
LLAMA70 = PRESETS["llama3-70b"]


def test_batch_one_decode_reads_the_weights_once_per_step():
    """Pope et al.: at batch 1 the block GEMMs take about weights / achievable bandwidth."""
    cost = ReplicaCost(LLAMA8, device_named("H100-SXM"), tp=1, pp=1)
    step = cost.step(1, 1, 100)
    block_weights = LLAMA8.layer_params_total() * 2
    assert step.gemm_s == pytest.approx(block_weights / cost.device.bandwidth, rel=0.1)
    # 64 decodes cost barely more than one (memory-bound), 4096 tokens far more (compute-bound)
    assert cost.step(64, 64, 6400).gemm_s < 1.1 * step.gemm_s
    assert cost.step(4096, 0, 0, [(0, 4096)]).gemm_s > 5 * step.gemm_s
    # the crossover: gemm rate x 2 bytes / (2 x bandwidth), a few hundred tokens on H100
    assert cost.crossover_batch == pytest.approx(cost.device.gemm_peak / cost.device.bandwidth, rel=1e-9)
    assert 150 < cost.crossover_batch < 400


def test_fp8_halves_the_weight_read_and_the_kv_dtype_the_cache():
    bf16 = ReplicaCost(LLAMA8, device_named("H100-SXM"), 1, 1)
    fp8 = ReplicaCost(LLAMA8, device_named("H100-SXM"), 1, 1, dtype="fp8", kv_dtype="fp8")
    assert fp8.step(1, 1, 0).gemm_s == pytest.approx(bf16.step(1, 1, 0).gemm_s / 2, rel=0.1)
    assert fp8.weight_bytes == pytest.approx(bf16.weight_bytes / 2)
    assert fp8.decode_attention_s(10**6, 8) == pytest.approx(bf16.decode_attention_s(10**6, 8) / 2, rel=0.05)
    # K and V of 32 layers x 8 kv heads x 128 dims: 128 KiB per token in bf16 (Llama 3 8B)
    assert kv_bytes_per_token(LLAMA8, 1, 1, "bf16") == 2 * 32 * 8 * 128 * 2


def test_tp_latency_dominates_decode_on_a_slow_link():
    """TPI-LLM: on Wi-Fi the per-layer all-reduce latency, not bandwidth, sets the decode step."""
    wifi = parse_cluster("4x1xcpu:nic=100Mb/s,nic_latency=5ms")
    replica = place(PRESETS["small"], wifi, ServeLayout(tp=4), kv_blocks=64)[0]
    step = replica.cost.step(1, 1, 64)
    assert step.tp_comm_s > 0.9 * step.stage_s - step.host_s
    assert step.tp_comm_s == pytest.approx(PRESETS["small"].layers * 2 * 2 * 2 * 5e-3, rel=0.05)  # 2 log2(4) hops


def test_kv_capacity_fills_what_the_weights_leave():
    cluster = parse_cluster("1x8xH100-SXM")
    one = place(LLAMA70, cluster, ServeLayout(tp=8))[0]
    two = place(LLAMA70, cluster, ServeLayout(tp=4, replicas=2))
    assert len(two) == 2 and two[1].devices[0] == (4, 5, 6, 7)
    assert one.memory_bytes <= 0.9 * 80e9 + 1
    # tp=8 stores one kv head per rank, tp=4 two: per-device bytes per token double, weights double too
    assert two[0].kv_blocks < one.kv_blocks
    with pytest.raises(SpecError, match="no room for a KV cache"):
        place(LLAMA70, cluster, ServeLayout(tp=1))
    with pytest.raises(SpecError, match="the cluster has 8"):
        place(LLAMA70, cluster, ServeLayout(tp=8, replicas=2))


def test_rate_and_saturation():
    cluster = parse_cluster("1x1xH100-SXM")
    replicas = place(LLAMA8, cluster, ServeLayout())
    limits = BatchLimits()
    light = estimate_serving(replicas, limits, Workload(rate=1.0), 1)
    full = estimate_serving(replicas, limits, Workload(rate=math.inf), 1)
    over = estimate_serving(replicas, limits, Workload(rate=full.requests_per_s * 1.5), 1)
    assert light.requests_per_s == pytest.approx(1.0) and not light.saturated
    assert light.tpot_s < full.tpot_s and light.ttft_s < 0.2
    assert over.saturated and math.isinf(over.ttft_s) and over.requests_per_s == pytest.approx(
        full.requests_per_s, rel=0.05)
    assert not over.meets(Workload(ttft_slo=2.0))


def test_workload_parsing_and_traces(tmp_path):
    assert parse_length("512:256", "--prompt-len") == Length(512, 256)
    lognormal = Length(512, 256)
    import random

    rng = random.Random(0)
    samples = [lognormal.sample(rng) for _ in range(4000)]
    assert sum(samples) / len(samples) == pytest.approx(512, rel=0.05)
    for bad in ("abc", "0", "5:-1"):
        with pytest.raises(SpecError, match="--prompt-len"):
            parse_length(bad, "--prompt-len")
    with pytest.raises(SpecError, match="not both"):
        Workload(rate=1.0, batch=4)
    csv_file = tmp_path / "t.csv"
    csv_file.write_text("arrival_s,prompt_tokens,output_tokens\n0.5,10,3\n0,20,4\n")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"arrival_s": 0, "prompt_tokens": 20, "output_tokens": 4}\n'
                     '{"arrival_s": 0.5, "prompt_tokens": 10, "output_tokens": 3}\n')
    assert load_trace(csv_file) == load_trace(jsonl)
    assert Workload(trace=load_trace(csv_file)).offered_rate == pytest.approx(2.0)
    (tmp_path / "bad.csv").write_text("arrival_s,prompt_tokens\n0,3\n")
    with pytest.raises(SpecError, match="needs the fields"):
        load_trace(tmp_path / "bad.csv")


def test_estimate_serve_json(capsys):
    assert main(["estimate", "--serve", "--model", "llama3-70b", "--cluster", "1x8xH100-SXM", "--tp", "8",
                 "--rate", "5", "--ttft-slo", "2", "--tpot-slo", "0.05", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("ttft_s", "tpot_s"):
        assert set(out[key]) == {"mean", "p90"} and 0 < out[key]["mean"] <= out[key]["p90"]
    assert out["requests_per_s"] == pytest.approx(5.0)
    assert out["output_tokens_per_s"] == pytest.approx(5.0 * 128)
    assert out["kv_tokens"] > 100_000 and 40 < out["memory_gib"] < 80
    assert out["meets_targets"] is True


@pytest.mark.parametrize("argv, field", [(["--rate", "-1"], "--rate"), (["--prompt-len", "x"], "--prompt-len"),
                                         (["--tp", "3"], "--tp"), (["--trace", "/nonexistent.csv"], "--trace")])
def test_estimate_serve_bad_input(capsys, argv, field):
    assert main(["estimate", "--serve", "--model", "llama3-8b", "--cluster", "1x8xH100-SXM", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}=")


def test_dev_set_mape_stays_under_the_target():
    spec = importlib.util.spec_from_file_location("validate_serving", ROOT / "bench" / "validate_serving.py")
    validate = importlib.util.module_from_spec(spec)
    sys.modules["validate_serving"] = validate  # its dataclasses look their module up
    spec.loader.exec_module(validate)
    if not (validate.DEFAULT_REFERENCE / "serving_gptfast.csv").is_file():
        pytest.skip("shared/reference is not beside this checkout")
    rows = validate.all_rows()
    assert len(rows) >= 450
    assert validate.mape(rows) <= validate.TARGET_MAPE
    assert validate.mape([r for r in rows if r.source == "gpt-fast"]) <= validate.TARGET_MAPE


def test_serving_flags_need_serve_and_requests_must_fit_the_cache(capsys, tmp_path):
    assert main(["estimate", "--rate", "5"]) == 2
    assert capsys.readouterr().err.strip() == "error: --rate='5': is a serving flag; add --serve (or drop it)"
    assert main(["simulate", "--serve", "--model", "llama3-8b", "--cluster", "1x1xH100-SXM", "--kv-blocks", "10",
                 "--out-dir", str(tmp_path / "sim")]) == 2
    assert capsys.readouterr().err.startswith("error: --output-len='512+128 tokens': a request longer than the KV")
    assert not (tmp_path / "sim").exists()
