"""`plan --serve` (planner/serving.py): the split search, goodput ranking, explanations, mixed and edge clusters."""

import json

import pytest

from fivefold.cli import main
from fivefold.planner.serving import search_serving
from fivefold.spec import PRESETS, parse_cluster
from fivefold.spec.workload import Length, Workload

LLAMA70 = PRESETS["llama3-70b"]


def test_goodput_ranking_uses_only_the_replicas_the_rate_needs():
    workload = Workload(Length(1024, 512), Length(256, 128), rate=5.0, ttft_slo=2.0, tpot_slo=0.05)
    candidates = search_serving(LLAMA70, parse_cluster("1x8xH100-SXM"), workload, "bf16", "bf16", {})
    best = candidates[0]
    assert best.meets and best.estimate.meets(workload)
    assert best.estimate.tpot_p90_s <= 0.05 and best.estimate.ttft_p90_s <= 2.0
    assert best.goodput_rps >= 5.0 and best.score == pytest.approx(best.goodput_rps / best.layout.replicas
                                                                   / (best.layout.tp * best.layout.pp), rel=1e-6)
    assert [c.score for c in candidates if c.meets] == sorted((c.score for c in candidates if c.meets), reverse=True)
    splits = {(c.layout.tp, c.layout.pp) for c in candidates}
    assert (8, 1) in splits and (1, 1) not in splits  # 70B in bf16 does not fit one H100
    # a fixed degree fixes the search
    fixed = search_serving(LLAMA70, parse_cluster("1x8xH100-SXM"), workload, "bf16", "bf16", {"tp": 8})
    assert {c.layout.tp for c in fixed} == {8}


def test_without_targets_throughput_per_device_ranks_and_fills_the_cluster():
    candidates = search_serving(LLAMA70, parse_cluster("2x8xH100-SXM"), Workload(), "bf16", "bf16", {})
    best = candidates[0]
    assert best.layout.devices == 16
    assert best.score == pytest.approx(best.estimate.output_tokens_per_s / 16, rel=1e-6)


def test_nothing_meets_says_why(capsys):
    assert main(["plan", "--serve", "--model", "llama3-70b", "--cluster", "1x8xH100-SXM", "--rate", "5",
                 "--tpot-slo", "0.002", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not any(c["meets_targets"] for c in out["candidates"])
    assert out["explanation"][0] == "No layout meets the targets. Closest splits:"
    assert "decodes at" in out["explanation"][1] and "target 2 ms" in out["explanation"][1]


def test_plan_serve_json_candidates_carry_degrees_and_estimate_fields(capsys):
    assert main(["plan", "--serve", "--model", "llama3-70b", "--cluster", "1x8xH100-SXM", "--rate", "5",
                 "--prompt-len", "1024:512", "--output-len", "256:128", "--ttft-slo", "2", "--tpot-slo", "0.05",
                 "--json"]) == 0
    candidate = json.loads(capsys.readouterr().out)["candidates"][0]
    for key in ("tp", "pp", "replicas", "ep", "max_batch", "max_tokens_per_step", "ttft_s", "tpot_s",
                "output_tokens_per_s", "requests_per_s", "kv_tokens", "memory_gib"):
        assert key in candidate
    assert candidate["requests_per_s"] == pytest.approx(5.0) and candidate["meets_targets"]


def test_mixed_cluster_and_moe_expert_parallel():
    cluster = parse_cluster("1x8xH100-SXM+1x8xA100-80GB")
    workload = Workload(rate=4.0, ttft_slo=1.0, tpot_slo=0.05)
    candidates = search_serving(PRESETS["mixtral-8x7b"], cluster, workload, "bf16", "bf16", {})
    assert any(c.layout.ep == c.layout.tp > 1 for c in candidates) and any(c.layout.ep == 1 for c in candidates)
    full = search_serving(PRESETS["mixtral-8x7b"], cluster, Workload(), "bf16", "bf16", {"tp": 8, "ep": 1})
    deployment = full[0].estimate
    assert len(deployment.replicas) == 2  # one replica on each group
    h100, a100 = deployment.replicas
    assert h100.share > a100.share  # the router gives the faster replica more


def test_edge_laptops_on_wifi_prefer_fewer_tp_hops_when_latency_grows():
    """TPI-LLM: on a high-latency link every tp all-reduce pays the latency twice per layer."""
    workload = Workload(Length(128), Length(64), batch=1)
    fast = search_serving(PRESETS["llama3-8b"], parse_cluster("4x1xcpu:speed=4,nic=1Gb/s,nic_latency=0.2ms"),
                          workload, "fp32", "fp32", {"replicas": 1})
    slow = search_serving(PRESETS["llama3-8b"], parse_cluster("4x1xcpu:speed=4,nic=300Mb/s,nic_latency=20ms"),
                          workload, "fp32", "fp32", {"replicas": 1})
    assert fast[0].layout.tp == 4
    assert slow[0].layout.tp < 4
    step = next(c for c in slow if c.layout.tp == 4).estimate.replicas[0].stage
    assert step.tp_comm_s > 0.5 * step.stage_s


def test_plan_and_estimate_serve_human_output(capsys):
    common = ["--serve", "--model", "llama3-70b", "--cluster", "1x8xH100-SXM", "--rate", "5", "--ttft-slo", "2",
              "--tpot-slo", "0.05"]
    assert main(["plan", *common]) == 0
    out = capsys.readouterr().out
    assert "score: goodput, requests/s per device meeting both p90 targets" in out
    assert "Best: tp=" in out and "decode turns compute-bound at ~251 tokens per step" in out
    assert main(["estimate", *common, "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "where a step's time goes" in out and "tensor-parallel all-reduces" in out and "meets TTFT" in out
