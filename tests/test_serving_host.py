"""The serving engine's host costs (profile/serving.py -> HostCosts.serve_* -> cost/serving.py): the profile
record round-trips, the fit recovers hand-made coefficients, the probe runs the real engine, and a profiled
device's serving step charges exactly the hand formula."""

from __future__ import annotations

import pytest

from fivefold.cost.comm import SELF
from fivefold.cost.serving import STEP_HOST_S, ReplicaCost
from fivefold.spec import PRESETS, parse_cluster
from fivefold.spec.cluster import Calibration, HostCosts, calibration_from_dict, cluster_from_dict
from fivefold.spec.devices import device_named

HOST = HostCosts(op_forward=5e-6, serve_step=300e-6, serve_request=40e-6, serve_layer=500e-6,
                 serve_attention_group=120e-6, serve_worker_step=150e-6)


def test_serving_host_costs_round_trip_through_the_cluster_file():
    calibration = Calibration(gemm=((64, 64, 64, "fp32", 1e10),), source="test", host=HOST, processes=1, threads=1)
    assert calibration_from_dict(calibration.to_dict(), "cluster.group[0]") == calibration
    cluster = parse_cluster("1x2xcpu")
    group = cluster.groups[0]
    profiled = type(cluster)((type(group)(**{**group.__dict__, "calibration": calibration}),))
    again = cluster_from_dict(profiled.to_dict())
    assert again.groups[0].calibration.host == HOST and again.groups[0].calibration.host.serving
    assert not HostCosts(op_forward=1e-6).serving  # a profile from before the serving probe


def test_a_negative_serving_cost_is_refused_naming_the_key():
    from fivefold.errors import SpecError

    with pytest.raises(SpecError, match="calibration.host.serve_layer"):
        calibration_from_dict({"host": {"serve_layer": -1.0}}, "cluster.group[0]")


def test_the_fit_recovers_the_costs_a_step_is_made_of():
    from fivefold.profile.serving import fit_serving_host

    step, request, layer, group = 300e-6, 40e-6, 500e-6, 120e-6
    decode = {(layers, batch): step + request * batch + layers * layer for layers in (1, 4) for batch in (1, 16)}
    prefill = {(layers, chunks): step + request * chunks + layers * (layer + group * (chunks - 1))
               for layers in (1, 4) for chunks in (1, 4)}
    fitted = fit_serving_host(decode, prefill)
    assert fitted == pytest.approx({"serve_step": step, "serve_request": request, "serve_layer": layer,
                                    "serve_attention_group": group}, rel=1e-9)


def test_the_probe_times_the_real_engine(monkeypatch):
    """measure_serving_host on the real Engine and LocalExecutor, cut to a few steps: a deeper stage costs more
    per step, so the per-layer cost comes out positive; every cost is a number of seconds."""
    from fivefold.profile import serving

    monkeypatch.setattr(serving, "LAYERS", (1, 3))
    monkeypatch.setattr(serving, "DECODE_BATCHES", (1, 4))
    monkeypatch.setattr(serving, "QUICK", (2, 4, 2))
    monkeypatch.setattr(serving, "WAKE_IDLE_S", 0.01)
    costs = serving.measure_serving_host(quick=True)
    assert set(costs) == {"serve_step", "serve_request", "serve_layer", "serve_attention_group", "serve_wake",
                          "serve_cpu_share"}
    assert all(0.0 <= value <= 1.0 for value in costs.values())
    assert costs["serve_layer"] > 0.0


def _replica(tp: int, pp: int, on_workers: bool, host: HostCosts | None = HOST) -> ReplicaCost:
    calibration = Calibration(host=host, processes=1, threads=1) if host is not None else None
    return ReplicaCost(PRESETS["tiny"], device_named("cpu"), tp, pp, "fp32", "fp32", 1, SELF, SELF,
                       calibration=calibration, on_workers=on_workers)


@pytest.mark.parametrize("tp,pp,on_workers", [(1, 1, False), (2, 1, True), (1, 2, True)])
def test_a_profiled_device_charges_the_engines_measured_host_work(tp, pp, on_workers):
    """3 decodes and 2 prefill chunks: 5 requests, 3 attention calls per layer (the decodes together, each
    chunk alone); host_s once per step, stage_host_s on each of the pp stages."""
    replica = _replica(tp, pp, on_workers)
    step = replica.step(3 + 40, 3, 300, [(0, 20), (10, 20)], samples=4)
    layers = -(-PRESETS["tiny"].layers // pp)
    worker = HOST.serve_worker_step if on_workers else 0.0
    assert step.host_s == pytest.approx(HOST.serve_step + 5 * HOST.serve_request + worker)
    assert step.stage_host_s == pytest.approx(layers * (HOST.serve_layer + 2 * HOST.serve_attention_group))
    assert step.latency_s == pytest.approx((step.stage_s - step.host_s) * pp + step.host_s)
    # A pipeline of workers: each stage boundary pays another trip to a worker (the send itself is free on this
    # link).
    assert step.pp_send_s == pytest.approx(HOST.serve_worker_step if pp > 1 else 0.0)
    decode = replica.step(8, 8, 800)  # decodes only: one attention call per layer
    assert decode.stage_host_s == pytest.approx(layers * HOST.serve_layer)


def test_without_a_serving_profile_the_fitted_step_host_time_stays():
    replica = _replica(1, 1, False, host=None)
    step = replica.step(8, 8, 800)
    assert step.host_s == STEP_HOST_S and step.stage_host_s == 0.0
    old_profile = _replica(1, 1, False, host=HostCosts(op_forward=5e-6))
    assert old_profile.step(8, 8, 800).host_s == STEP_HOST_S


def test_the_profile_times_decode_gemms_with_their_weights_out_of_cache():
    """On a CPU the decode shapes rotate over distinct weights filling DECODE_WORKING_SET; a GPU leaves them out."""
    import torch

    from fivefold.profile.kernels import DECODE_SHAPES, DECODE_WORKING_SET, _gemm_work, gemm_shapes

    assert set(DECODE_SHAPES) <= set(gemm_shapes(True)) and not set(DECODE_SHAPES) & set(gemm_shapes(True, cpu=False))
    m, n, k = DECODE_SHAPES[0]
    work, calls = _gemm_work(m, n, k, torch.float32, torch.device("cpu"))
    assert calls * n * k * 4 >= DECODE_WORKING_SET
    outputs = work()
    assert len(outputs) == calls and outputs[0].shape == (m, n)
    assert _gemm_work(64, 64, 64, torch.float32, torch.device("cpu"))[1] == 1


def test_a_decode_gemm_takes_the_measured_rate_of_its_intensity():
    """A 1-row GEMM's intensity (~0.5 FLOP/byte in fp32) is the decode point's: its time is its FLOPs at the
    rate measured there, not at the smallest square's."""
    decode_rate, square_rate = 4e9, 1.3e10
    calibration = Calibration(gemm=((1, 512, 512, "fp32", decode_rate), (32, 32, 32, "fp32", square_rate)),
                              host=HOST, processes=1, threads=1)
    replica = ReplicaCost(PRESETS["tiny"], device_named("cpu"), 1, 1, "fp32", "fp32", 1, SELF, SELF,
                          calibration=calibration)
    h = PRESETS["tiny"].hidden
    from fivefold.cost.serving import skinny_gemm_time

    assert skinny_gemm_time(replica.device, 1, 512, 512) == pytest.approx(2 * 512 * 512 / decode_rate)
    assert skinny_gemm_time(replica.device, 1, h, h) == pytest.approx(2 * h * h / decode_rate, rel=0.02)


def test_an_idle_replicas_first_step_pays_the_engines_wake_up():
    """Two requests far apart: each finds its replica idle, and only its first step (the prefill) is longer, by
    serve_wake; without a profiled engine nothing changes."""
    from fivefold.cost.deployment import Replica
    from fivefold.sim.serving import simulate_serving
    from fivefold.spec.serve import BatchLimits
    from fivefold.spec.workload import Request, Workload

    def replay(host: HostCosts | None):
        replica = Replica(((0,),), _replica(1, 1, False, host=host), 64, 0.0)
        workload = Workload(trace=(Request(0.0, 16, 4), Request(5.0, 16, 4)), num_requests=2)
        return simulate_serving([replica], BatchLimits(kv_blocks=64), workload, pp=1)

    woken = HostCosts(**{**HOST.to_dict(), "serve_wake": 2e-3})
    plain, slept = replay(HOST), replay(woken)
    for before, after in zip(plain.requests, slept.requests):
        assert after.ttft_s == pytest.approx(before.ttft_s + 2e-3)
        assert after.finish_s - after.first_token_s == pytest.approx(before.finish_s - before.first_token_s)


def test_cold_reads_are_a_latency_per_call_plus_bytes_at_a_bandwidth():
    """cold_stream recovers (latency, bandwidth) from one-row GEMMs at two sizes; a profiled engine's decode step
    reads every weight matrix of fivefold's blocks (q, k, v, o, gate, up, down: 7 calls a layer) and its KV blocks
    (one gather a layer) at least at that cost."""
    from fivefold.cost.serving import cold_stream

    latency, bandwidth = 12e-6, 9.5e9
    points = tuple((1, size, size, "fp32", 2.0 * size * size / (latency + 4 * size * size / bandwidth))
                   for size in (256, 512))
    stream = cold_stream(Calibration(gemm=points, host=HOST, processes=1, threads=1), "fp32")
    assert stream.latency_s == pytest.approx(latency) and stream.bandwidth == pytest.approx(bandwidth)
    assert cold_stream(Calibration(gemm=points[:1], host=HOST), "fp32") is None
    replica = ReplicaCost(PRESETS["tiny"], device_named("cpu"), 1, 1, "fp32", "fp32", 1, SELF, SELF,
                          calibration=Calibration(gemm=points, host=HOST, processes=1, threads=1))
    m = PRESETS["tiny"]
    per_layer_weights = 4 * (2 * m.hidden * m.heads * m.head_dim + 2 * m.hidden * m.kv_heads * m.head_dim
                             + 3 * m.hidden * m.ffn_hidden)
    step = replica.step(1, 1, 100)
    assert step.gemm_s >= m.layers * (7 * latency + per_layer_weights / bandwidth) * (1 - 1e-9)
    kv = 100 * 2 * m.kv_heads * m.head_dim * 4
    assert step.attention_s == pytest.approx(m.layers * (latency + kv / bandwidth))
