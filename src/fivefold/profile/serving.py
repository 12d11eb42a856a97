"""Host costs of fivefold's serving engine on CPU: what a step of `fivefold serve` / `generate` spends in Python
(the batching Scheduler, batch building, the paged-attention index, eager module calls, sampling, the worker
queues) apart from arithmetic.

The real code runs on a model of negligible size (hidden 32, vocab 16: serve_probe_spec), so what is left is the
per-step, per-request and per-layer cost, not the work. These four are timed in CPU seconds of the measuring thread
(time.thread_time; the in-process executor runs a step on it, one intra-op thread): on a shared machine the wall
time of a step is its CPU time over the share of a core the process gets, and that share changes from one minute
to the next, so a wall-clock probe would record the neighbours' load of the moment instead of the engine's cost.
The prediction is then the one for a core of the process's own; `fivefold report` shows the share a run got.
- serve_step, serve_request, serve_layer, serve_attention_group: Engine.step() over the in-process executor
  (serve/executor.LocalExecutor, the tp1 x pp1 path) for decode steps of B requests and prefill steps of G
  chunks, on stages of L layers; a least-squares fit of
  step = serve_step + serve_request x requests + L x (serve_layer + serve_attention_group x (groups - 1)),
  where groups are the step's attention calls per layer (all the decodes together, each prefill chunk alone:
  serve/batch.py);
- serve_worker_step (wall seconds: waking a process is waiting, not work): what running a step on a worker process
  adds (serve/workers.py: the StepBatch pickled into a worker's inbox, the process woken, the sampled rows' logits
  back through the results queue): one request decoding on the 2-layer probe model on one worker (WorkerPool)
  against the same in this process, the two taking turns. A pipeline's further stages are not timed here (two more
  worker processes to start, and on a shared machine a reading that swung between 0 and 1.4 ms per stage):
  cost/serving.py charges each stage boundary another such trip (its inbox and wake-up) plus the gloo send, which
  the profile's send_recv curve holds.
- serve_wake (wall seconds): what the first step after the engine slept (ArrivalQueue and the server sleep while no
  request is there) takes beyond the same step run right after another: one prefill step on the 4-layer stage after
  WAKE_IDLE_S asleep against one right after a step, the two taking turns. Here ~1-1.5 ms: idle, the core's caches,
  TLBs and branch predictors lose the engine's working set (a 4-layer tiny model's first step after 0.25 s idle:
  +0.9 ms of CPU time, and a request that arrives at an idle engine waits ~2.5 ms longer for its first token than
  the same prefill run back to back). sim/serving.py charges it to the first step of an idle replica.
serve_cpu_share records the share of a core the probe got while it wanted one (local.CpuShare), for the record.
The ranks of `fivefold profile` measure the first four at once; the worker step is timed by the launching
process, with 2 or more processes (the ranks have ended by then).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from fivefold.spec import ModelSpec

# The runtime's default family (RoPE, RMSNorm, SwiGLU, grouped-query attention) at a negligible size.
SERVE_PROBE_MODEL = ModelSpec(name="serve-probe", layers=1, hidden=32, heads=4, kv_heads=2, ffn_hidden=32, vocab=16,
                              max_seq_len=4096)
DECODE_BATCHES = (1, 16)  # requests per decode step
PREFILL_CHUNKS = (1, 4)  # prefill chunks (of PREFILL_TOKENS each) in one step
PREFILL_TOKENS = 8
LAYERS = (1, 4)  # stage depths
KV_BLOCKS = 512
# (rounds, decode steps per batch size and round, prefill steps per chunk count and round)
QUICK, FULL = (4, 8, 3), (8, 16, 6)
WAKE_IDLE_S = 0.1  # how long the engine sleeps before a timed wake-up step


@dataclass(frozen=True)
class _ProbeSource:
    """What serve/runner.build_runner reads of a ModelSource: the spec and the weights (in memory here)."""

    spec: ModelSpec
    state: dict
    path: str = ""

    def load_state_dict(self) -> dict:
        return self.state


def serve_probe_spec(layers: int) -> ModelSpec:
    return replace(SERVE_PROBE_MODEL, layers=layers)


def _engine(layers: int):
    import torch

    from fivefold.models import build_model, init_weights
    from fivefold.serve.engine import Engine
    from fivefold.serve.executor import LocalExecutor
    from fivefold.spec.serve import BatchLimits, ServeLayout

    spec = serve_probe_spec(layers)
    model = build_model(spec, device="meta")
    model.to_empty(device="cpu")
    init_weights(model, 0)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    layout = ServeLayout(dtype="fp32", kv_dtype="fp32", limits=BatchLimits(kv_blocks=KV_BLOCKS))
    source = _ProbeSource(spec, state)
    with torch.inference_mode():
        executor = LocalExecutor(source, layout)  # type: ignore[arg-type]
    executor.source = source  # type: ignore[attr-defined]  (measure_worker_step starts a worker of it)
    return Engine(executor, layout, max_context=spec.max_seq_len)


def _decode_times(engine, batch: int, steps: int, tag: str) -> list[float]:
    """Seconds of each of `steps` decode steps of `batch` requests (after their one-step prefill)."""
    from fivefold.serve.engine import Request

    requests = [Request(f"{tag}-{i}", [1 + i % 15, 2, 3, 4], steps + 2) for i in range(batch)]
    for request in requests:
        engine.add(request)
    engine.step()  # the prompts
    engine.step()  # first decode (warm)
    times = []
    while engine.busy:
        start = time.thread_time()
        engine.step()
        times.append(time.thread_time() - start)
    return times[:-1] or times  # the last step also retires every request


def _prefill_times(engine, chunks: int, repeats: int, tag: str) -> list[float]:
    """Seconds of each of `repeats` steps computing `chunks` prompts of PREFILL_TOKENS each (each samples one
    token and finishes)."""
    from fivefold.serve.engine import Request

    times = []
    for round_ in range(repeats):
        for i in range(chunks):
            engine.add(Request(f"{tag}-{round_}-{i}", [1 + (i + j) % 15 for j in range(PREFILL_TOKENS)], 1))
        start = time.thread_time()
        while engine.busy:
            engine.step()
        times.append(time.thread_time() - start)
    return times


def _wake_pair(engine, tag: str) -> tuple[float, float]:
    """Wall seconds of one prefill step right after another, and of the same step after WAKE_IDLE_S asleep."""
    from fivefold.serve.engine import Request

    def one_step(name: str) -> float:
        engine.add(Request(name, [1 + j % 15 for j in range(PREFILL_TOKENS)], 1))
        start = time.perf_counter()
        while engine.busy:
            engine.step()
        return time.perf_counter() - start

    one_step(f"{tag}-before")
    warm = one_step(f"{tag}-warm")
    time.sleep(WAKE_IDLE_S)
    return warm, one_step(f"{tag}-woken")


def fit_serving_host(decode: dict[tuple[int, int], float],
                     prefill: dict[tuple[int, int], float]) -> dict[str, float]:
    """Least squares of step = serve_step + serve_request x requests + layers x (serve_layer +
    serve_attention_group x (groups - 1)) over decode steps {(layers, requests): s} (one attention group) and
    prefill steps {(layers, chunks): s} (a group per chunk); each cost clamped at 0."""
    rows, seconds = [], []
    for (layers, requests), value in decode.items():
        rows.append([1.0, requests, layers, 0.0])
        seconds.append(value)
    for (layers, chunks), value in prefill.items():
        rows.append([1.0, chunks, layers, layers * (chunks - 1)])
        seconds.append(value)
    solution = np.linalg.lstsq(np.array(rows), np.array(seconds), rcond=None)[0]
    names = ("serve_step", "serve_request", "serve_layer", "serve_attention_group")
    return {name: max(0.0, float(value)) for name, value in zip(names, solution)}


def measure_serving_host(quick: bool, line_up: Callable[[], None] = lambda: None) -> dict[str, float]:
    """serve_step, serve_request, serve_layer, serve_attention_group and serve_wake of this process (module
    docstring), and serve_cpu_share: the share of a core it got while measuring (local.CpuShare). The
    configurations take turns, round after round, and each keeps the median of all its steps: on a shared
    machine the neighbours' load drifts, and a drift between two configurations would land in their difference."""
    from fivefold.local import CpuShare

    rounds, steps, repeats = QUICK if quick else FULL
    engines = {layers: _engine(layers) for layers in LAYERS}
    share = CpuShare()
    decode: dict[tuple[int, int], list[float]] = {(l, b): [] for l in LAYERS for b in DECODE_BATCHES}
    prefill: dict[tuple[int, int], list[float]] = {(l, c): [] for l in LAYERS for c in PREFILL_CHUNKS}
    warm, woken = [], []
    try:
        for layers, engine in engines.items():  # warm-up: first calls, lazy allocations
            _prefill_times(engine, 1, 1, "warm")
        for round_ in range(rounds):
            for layers, engine in engines.items():
                for batch in DECODE_BATCHES:
                    line_up()
                    decode[(layers, batch)] += _decode_times(engine, batch, steps, f"d{round_}-{batch}")
                for chunks in PREFILL_CHUNKS:
                    line_up()
                    prefill[(layers, chunks)] += _prefill_times(engine, chunks, repeats, f"p{round_}-{chunks}")
            for repeat in range(repeats):
                line_up()
                pair = _wake_pair(engines[max(LAYERS)], f"w{round_}-{repeat}")
                warm.append(pair[0])
                woken.append(pair[1])
    finally:
        for engine in engines.values():
            engine.executor.close()
    costs = fit_serving_host({key: statistics.median(v) for key, v in decode.items()},
                             {key: statistics.median(v) for key, v in prefill.items()})
    wake = max(0.0, statistics.median(woken) - statistics.median(warm))
    return {**costs, "serve_wake": wake, "serve_cpu_share": share.share() or 0.0}


def _token_intervals(engine, tokens: int, tag: str) -> list[float]:
    """Seconds between consecutive tokens of one request decoding alone: each step waits for the one before (the
    latency of a step through every stage and back to the engine)."""
    from fivefold.serve.engine import Request

    engine.add(Request(tag, [1, 2, 3, 4], tokens + 2))
    while engine.generated_tokens < 2:  # its prompt and first decode (warm)
        engine.step()
    intervals, seen, last = [], engine.generated_tokens, time.perf_counter()
    while engine.busy:
        engine.step()
        if engine.generated_tokens > seen:
            now = time.perf_counter()
            intervals.append(now - last)
            seen, last = engine.generated_tokens, now
    return intervals


def measure_worker_step(quick: bool) -> dict[str, float]:
    """serve_worker_step (module docstring): the medians of the intervals between the tokens of one request decoding
    on the 2-layer probe model in this process and on one worker process (serve/workers.WorkerPool)."""
    from fivefold.serve.engine import Engine
    from fivefold.serve.workers import WorkerPool
    from fivefold.spec.serve import ServeLayout

    rounds, steps, _ = QUICK if quick else FULL
    rounds = max(2, rounds // 2)  # starting the worker process is most of this measurement's time
    local = _engine(2)
    source = local.executor.source
    pool = WorkerPool(source, ServeLayout(dtype="fp32", kv_dtype="fp32", limits=local.layout.limits))
    engines = {"local": local, "worker": Engine(pool, pool.layout, max_context=source.spec.max_seq_len)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for round_ in range(rounds):
            for name, engine in engines.items():
                times[name] += _token_intervals(engine, 4 * steps, f"{name}-{round_}")
    finally:
        local.executor.close()
        pool.close()
    return {"serve_worker_step": max(0.0, statistics.median(times["worker"]) - statistics.median(times["local"]))}
