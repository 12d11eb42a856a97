"""A serving run's record, for `fivefold report` (report/serving.py): what `generate --metrics-file
RUN/requests.jsonl` leaves in RUN.

- RUN/serve_run.json: the model, the layout (spec/serve.ServeLayout), the cluster the prediction is made for
  (--cluster: a `fivefold profile` file, or the catalog's), the device, the trace's arrivals and lengths (the
  workload), and the prediction made for it at launch (cost/serving_estimate.estimate_serving's fields);
- RUN/requests.jsonl: one line per request: arrival_s (since the first arrival), prompt_tokens, output_tokens,
  ttft_s, tpot_s, total_s, preemptions, finish_reason, replica; and the share of a core the engine and the workers
  got while they wanted one (cpu_share, local.CpuShare: the neighbours' part of the timings on a shared machine);
- RUN/steps.jsonl: one line per model step: replica, step number, submitted_s / done_s (since the first arrival),
  requests, tokens, decodes, prefill_chunks, and the replica's KV blocks in use, running and waiting requests
  when it was submitted.
StepRecorder wraps the executor (serve/executor.py) so the engine itself stays as it is."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RUN_FILE = "serve_run.json"
REQUESTS_FILE = "requests.jsonl"
STEPS_FILE = "steps.jsonl"


class StepRecorder:
    """An executor that records every step it runs (submit to the poll that returns its logits)."""

    def __init__(self, executor: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.executor, self.clock = executor, clock
        self.engine: Any = None  # set by attach(): the scheduler state recorded with each step
        self.steps: list[dict] = []
        self._open: dict[tuple[int, int], dict] = {}
        self.started()

    def started(self) -> None:
        """From now on, the share of a core the engine and the workers get while they want one (local.CpuShare)."""
        from fivefold.local import CpuShare

        workers = [process.pid for _, process in getattr(self.executor, "processes", [])]
        self.engine_share, self.worker_share = CpuShare(), CpuShare(workers) if workers else None

    def cpu_share(self) -> dict:
        return {"engine": self.engine_share.share(),
                "workers": self.worker_share.share() if self.worker_share is not None else None}

    def attach(self, engine: Any) -> None:
        self.engine = engine

    def submit(self, batch: Any) -> None:
        record: dict[str, Any] = {"replica": batch.replica, "step": batch.number, "submitted_s": self.clock(),
                                  "requests": len(batch.query_lens), "tokens": batch.num_tokens,
                                  "decodes": sum(1 for n, c in zip(batch.query_lens, batch.context_lens)
                                                 if n == 1 and c > 1),
                                  "samples": len(batch.sample_rows)}
        record["prefill_chunks"] = record["requests"] - record["decodes"]
        if self.engine is not None:
            scheduler = self.engine.schedulers[batch.replica]
            record.update(kv_blocks_in_use=scheduler.pool.in_use, running=len(scheduler.running),
                          waiting=len(scheduler.waiting))
        self._open[(batch.replica, batch.number)] = record
        self.executor.submit(batch)

    def poll(self, wait: float) -> list:
        done = self.executor.poll(wait)
        now = self.clock()
        for replica, number, _ in done:
            record = self._open.pop((replica, number))
            record["done_s"] = now
            self.steps.append(record)
        return done

    def close(self) -> None:
        self.executor.close()


class ArrivalQueue:
    """Adds each request to the engine when its arrival time comes (all at once without arrivals); sleeps while
    the engine is idle and the next one is still to come. A request's arrival is its scheduled time, so a late
    loop counts in its TTFT as it would for a client."""

    def __init__(self, engine: Any, requests: list, arrivals: list[float] | None, start: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine, self.clock, self.start = engine, clock, start
        times = arrivals if arrivals is not None else [0.0] * len(requests)
        self.pending = sorted(zip(times, range(len(requests))), reverse=True)
        self.requests = requests

    def __bool__(self) -> bool:
        return bool(self.pending)

    def admit(self) -> None:
        if self.pending and not self.engine.busy:
            time.sleep(max(0.0, self.start + self.pending[-1][0] - self.clock()))
        now = self.clock()
        while self.pending and self.start + self.pending[-1][0] <= now:
            arrival, index = self.pending.pop()
            request = self.requests[index]
            request.arrival = self.start + arrival
            self.engine.add(request)


def arrivals_queue(engine: Any, requests: list, arrivals: list[float] | None, start: float) -> ArrivalQueue:
    return ArrivalQueue(engine, requests, arrivals, start)


def default_serve_cluster(layout: Any, device: str) -> str:
    """The catalog cluster of this machine's devices: `1xNxcpu`, or N of this GPU."""
    if device == "cpu":
        return f"1x{layout.devices}xcpu"
    from fivefold.profile.run import catalog_name_of_cuda_device

    return f"1x{layout.devices}x{catalog_name_of_cuda_device()}"


def request_record(request: Any, start: float) -> dict:
    """One line of requests.jsonl (serve/engine.Request), times since `start` (the first arrival)."""
    return {"id": request.request_id, "arrival_s": request.arrival - start, "prompt_tokens": len(request.prompt_ids),
            "output_tokens": len(request.output_ids), **request.timings, "preemptions": request.preemptions,
            "finish_reason": request.finish_reason, "replica": request.replica}


def trace_prompts(path: str, vocab: int, seed: int) -> tuple[list[list[int]], list[int], list[float]]:
    """(prompt ids, max_tokens, arrival_s) of a request trace (spec/workload.load_trace): random token ids of each
    request's prompt length (seeded), its output length and arrival."""
    import random

    from fivefold.spec.workload import load_trace

    rng = random.Random(seed)
    trace = load_trace(path)
    prompts = [[rng.randrange(vocab) for _ in range(r.prompt_tokens)] for r in trace]
    return prompts, [r.output_tokens for r in trace], [r.arrival_s for r in trace]


def predict_run(model: Any, layout: Any, cluster_text: str, prompts: list[list[int]], max_tokens: list[int],
                arrivals: list[float] | None) -> dict:
    """serve_run.json's record of the launch: model, layout, cluster, workload (the requests as a trace) and what
    cost/serving_estimate.py and sim/serving.py predict for it (SpecError naming --cluster or the layout flag
    when the cluster cannot hold the layout)."""
    from fivefold.cost.deployment import place
    from fivefold.cost.serving_estimate import estimate_serving
    from fivefold.sim.serving import simulate_serving
    from fivefold.spec import parse_cluster
    from fivefold.spec.workload import Request, Workload

    cluster = parse_cluster(cluster_text)
    times = arrivals if arrivals is not None else [0.0] * len(prompts)
    trace = tuple(Request(t, len(ids), n) for t, ids, n in zip(times, prompts, max_tokens))
    # All at once (--input): the offline case, rate inf; a trace: its own arrivals.
    workload = Workload(trace=trace, num_requests=len(trace), rate=None if arrivals is not None else float("inf"))
    replicas = place(model, cluster, layout, kv_blocks=layout.limits.kv_blocks)
    estimate = estimate_serving(replicas, layout.limits, workload, layout.pp)
    simulated = simulate_serving(replicas, layout.limits, workload, layout.pp, record_steps=False)
    return {"model": model.to_dict(), "cluster": cluster.to_dict(), "cluster_label": cluster.label,
            "layout": layout.to_dict(), "workload": workload.to_dict(),
            "prediction": {"estimate": estimate.to_dict(), "simulated": simulated.to_dict()}}


def write_run(requests_path: Path, run: dict, requests: list, steps: list[dict], start: float,
              cpu_share: dict | None = None) -> None:
    """requests_path, and serve_run.json and steps.jsonl beside it (times since `start`); `cpu_share`: what
    StepRecorder.cpu_share measured over the run."""
    folder = requests_path.parent
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_FILE).write_text(json.dumps({**run, "requests_file": requests_path.name, "cpu_share": cpu_share},
                                              indent=1) + "\n")
    with requests_path.open("w") as handle:
        for request in requests:
            handle.write(json.dumps(request_record(request, start)) + "\n")
    with (folder / STEPS_FILE).open("w") as handle:
        for step in sorted(steps, key=lambda s: s["submitted_s"]):
            handle.write(json.dumps({**step, "submitted_s": step["submitted_s"] - start,
                                     "done_s": step["done_s"] - start}) + "\n")
