"""`simulate --serve` (sim/serving.py): the stream through batching.Scheduler with predicted step times."""

import json
import math

import pytest

from fivefold.cli import main
from fivefold.cost.deployment import place
from fivefold.cost.serving_estimate import estimate_serving
from fivefold.sim.serving import simulate_serving
from fivefold.spec import PRESETS, parse_cluster
from fivefold.spec.serve import BatchLimits, ServeLayout
from fivefold.spec.workload import Length, Workload

LLAMA8 = PRESETS["llama3-8b"]
H100x8 = parse_cluster("1x8xH100-SXM")


def test_closed_loop_batch_runs_b_requests_at_the_step_latency():
    replicas = place(LLAMA8, H100x8, ServeLayout())
    workload = Workload(prompt_len=Length(64), output_len=Length(32), batch=8, num_requests=64)
    result = simulate_serving(replicas, BatchLimits(), workload, 1)
    summary = result.to_dict()
    decode_steps = [s for s in result.steps if s.requests == 8 and s.tokens == 8]
    assert decode_steps and max(s.requests for s in result.steps) == 8
    step = replicas[0].cost.step(8, 8, 8 * 80, samples=8)
    assert decode_steps[10].end_s - decode_steps[10].start_s == pytest.approx(step.latency_s, rel=0.05)
    assert summary["tpot_s"]["p50"] == pytest.approx(step.latency_s, rel=0.1)
    assert all(r.finish_s > r.first_token_s >= r.arrival_s for r in result.requests)


def test_simulation_and_estimate_agree_on_a_steady_stream():
    replicas = place(LLAMA8, H100x8, ServeLayout())
    workload = Workload(prompt_len=Length(512), output_len=Length(128), rate=20.0, num_requests=800)
    estimate = estimate_serving(replicas, BatchLimits(), workload, 1)
    summary = simulate_serving(replicas, BatchLimits(), workload, 1).to_dict()
    assert summary["tpot_s"]["mean"] == pytest.approx(estimate.tpot_s, rel=0.15)
    assert summary["ttft_s"]["mean"] == pytest.approx(estimate.ttft_s, rel=0.5)
    assert summary["requests_per_s"] == pytest.approx(20.0, rel=0.15)


def test_small_cache_preempts_and_every_request_still_finishes():
    replicas = place(LLAMA8, H100x8, ServeLayout(), kv_blocks=40)  # 640 tokens for 4 x 200-token requests
    workload = Workload(prompt_len=Length(100), output_len=Length(100), rate=math.inf, num_requests=12)
    result = simulate_serving(replicas, BatchLimits(), workload, 1)
    assert result.preemptions > 0
    assert max(s.kv_blocks for s in result.steps) <= 40
    assert all(r.finish_s == r.finish_s for r in result.requests)


def test_pipeline_keeps_pp_steps_in_flight_and_replicas_share_the_stream():
    replicas = place(LLAMA8, H100x8, ServeLayout(pp=2, replicas=2))
    workload = Workload(prompt_len=Length(128), output_len=Length(64), rate=math.inf, num_requests=200)
    result = simulate_serving(replicas, BatchLimits(), workload, 2)
    steps = [s for s in result.steps if s.replica == 0]
    overlap = max(sum(1 for t in steps if t.start_s <= s.start_s < t.end_s) for s in steps)
    assert overlap == 2
    served = [sum(1 for r in result.requests if r.replica == k) for k in (0, 1)]
    assert served[0] == pytest.approx(100, abs=10) and sum(served) == 200


def test_simulate_serve_cli_writes_trace_and_picture(tmp_path, capsys):
    argv = ["simulate", "--serve", "--model", "llama3-8b", "--cluster", "1x8xH100-SXM", "--replicas", "2",
            "--rate", "10", "--prompt-len", "256:128", "--output-len", "64:32", "--requests", "200",
            "--out-dir", str(tmp_path), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 200 and out["replicas"] == 2
    assert out["ttft_s"]["p90"] >= out["ttft_s"]["p50"] > 0
    trace = json.loads((tmp_path / "serve_trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert (tmp_path / "serve_timeline.png").stat().st_size > 10_000


def test_estimate_follows_the_simulation_when_the_cache_binds_and_preempts():
    replicas = place(LLAMA8, H100x8, ServeLayout(), kv_blocks=1000)
    for prompt, output in ((512, 128), (128, 512)):
        workload = Workload(prompt_len=Length(prompt), output_len=Length(output), rate=math.inf, num_requests=600)
        result = simulate_serving(replicas, BatchLimits(), workload, 1)
        estimate = estimate_serving(replicas, BatchLimits(), workload, 1)
        assert result.preemptions > 0.1 * 600
        assert estimate.output_tokens_per_s == pytest.approx(result.to_dict()["output_tokens_per_s"], rel=0.08)
        no_evict = estimate_serving(replicas, BatchLimits(), workload, 1, no_evict=True)
        assert no_evict.replicas[0].running <= estimate.replicas[0].running  # whole requests reserved
