"""A serving run's record, for `fivefold report` (report/serving.py): what `generate --metrics-file
RUN/requests.jsonl` and `serve --metrics-file RUN/requests.jsonl` leave in RUN.

- RUN/serve_run.json: the verb, the model, the layout (spec/serve.ServeLayout), the cluster the prediction is made
  for (--cluster: a `fivefold profile` file, or the catalog's) and the share of a core the engine and the workers
  got while they wanted one (cpu_share, local.CpuShare: the neighbours' part of the timings on a shared machine;
  null until the run ends). `generate` knows its requests at launch: it records them as the workload, with the
  prediction made for them (report/serving.predict_trace). `serve` does not: its workload and prediction are null
  and `fivefold report` replays the requests it recorded, at their arrivals, through the same predict_trace;
- RUN/requests.jsonl: one line per finished request: arrival_s, prompt_tokens, output_tokens, ttft_s, tpot_s,
  total_s, preemptions, finish_reason, replica (times since the first arrival for generate, since the engine
  was built for serve);
- RUN/steps.jsonl: one line per model step: replica, step number, submitted_s / done_s (same clock), requests,
  tokens, decodes, prefill_chunks, and the replica's KV blocks in use, running and waiting requests when it was
  submitted.
RunWriter writes the three files, a line at a time (a server's are on disk while it runs: a killed server loses
at most its last second of steps). StepRecorder wraps the executor (serve/executor.py) so the engine itself
stays as it is."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fivefold.errors import require

RUN_FILE = "serve_run.json"
REQUESTS_FILE = "requests.jsonl"
STEPS_FILE = "steps.jsonl"
FLUSH_S = 1.0  # steps reach the disk at least this often while a server runs (a finished request at once)


class StepRecorder:
    """An executor that records every step it runs (submit to the poll that returns its logits)."""

    def __init__(self, executor: Any, clock: Callable[[], float] = time.perf_counter,
                 on_step: Callable[[dict], None] | None = None) -> None:
        """`on_step`: where each finished step goes (a server's RunWriter.step); without it, into `steps`."""
        self.executor, self.clock = executor, clock
        self.engine: Any = None  # set by attach(): the scheduler state recorded with each step
        self.steps: list[dict] = []
        self.on_step = on_step if on_step is not None else self.steps.append
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
            self.on_step(record)
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


def check_record_flags(args: argparse.Namespace) -> None:
    """--cluster only names the cluster of the prediction --metrics-file records (generate and serve alike)."""
    cluster = getattr(args, "cluster", None)
    require(cluster is None or getattr(args, "metrics_file", None) is not None, "--cluster", cluster,
            "is the cluster of the prediction --metrics-file records; add --metrics-file")


def launch_record(args: argparse.Namespace, model: Any, layout: Any, verb: str) -> tuple[dict, Any] | None:
    """serve_run.json's description of the launch (verb, model, cluster, layout) and the ClusterSpec, or None
    without --metrics-file. Checked before any worker starts: the file can be written, and the cluster holds the
    layout (cost/deployment.place: SpecError naming --cluster or the layout flag)."""
    if not getattr(args, "metrics_file", None):
        return None
    from fivefold.cost.deployment import place
    from fivefold.outputs import check_output_file
    from fivefold.spec import parse_cluster

    check_output_file(args.metrics_file, "--metrics-file", "RUN/requests.jsonl")
    cluster = parse_cluster(args.cluster or default_serve_cluster(layout, args.device))
    place(model, cluster, layout, kv_blocks=layout.limits.kv_blocks)
    return {"verb": verb, "model": model.to_dict(), "cluster": cluster.to_dict(), "cluster_label": cluster.label,
            "layout": layout.to_dict(), "workload": None, "prediction": None}, cluster


def predict_run(model: Any, layout: Any, launch: tuple[dict, Any], prompts: list[list[int]], max_tokens: list[int],
                arrivals: list[float] | None) -> dict:
    """generate's serve_run.json: the launch, its requests as a trace (all at once for --input: the offline case,
    rate inf; a trace: its own arrivals) and what report/serving.predict_trace predicts for them."""
    from fivefold.report.serving import predict_trace
    from fivefold.spec.workload import Request

    record, cluster = launch
    times = arrivals if arrivals is not None else [0.0] * len(prompts)
    trace = tuple(Request(t, len(ids), n) for t, ids, n in zip(times, prompts, max_tokens))
    return {**record, **predict_trace(model, cluster, layout, trace, all_at_once=arrivals is None)}


class RunWriter:
    """Writes a run folder (module docstring): serve_run.json at once, then a line per request and per step,
    times since `start`. A request's line is flushed at once, steps at least every FLUSH_S seconds; close()
    flushes, records the share of a core (`cpu_share()`) in serve_run.json and ignores what comes after it.
    Safe to call from the engine thread while another thread closes it."""

    def __init__(self, requests_path: Path, run: dict, start: float,
                 cpu_share: Callable[[], dict | None] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.folder, self.run, self.start = requests_path.parent, {**run, "requests_file": requests_path.name}, start
        self.cpu_share, self.clock = cpu_share, clock
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write_run(None)
        self.lock = threading.Lock()
        self.requests: IO[str] | None = requests_path.open("w")
        self.steps: IO[str] = (self.folder / STEPS_FILE).open("w")
        self.flushed = clock()

    def _write_run(self, cpu_share: dict | None) -> None:
        (self.folder / RUN_FILE).write_text(json.dumps({**self.run, "cpu_share": cpu_share}, indent=1) + "\n")

    def request(self, request: Any) -> None:
        line = json.dumps(request_record(request, self.start)) + "\n"
        with self.lock:
            if self.requests is not None:
                self.requests.write(line)
                self._flush()

    def step(self, step: dict) -> None:
        line = json.dumps({**step, "submitted_s": step["submitted_s"] - self.start,
                           "done_s": step["done_s"] - self.start}) + "\n"
        with self.lock:
            if self.requests is not None:
                self.steps.write(line)
                if self.clock() - self.flushed >= FLUSH_S:
                    self._flush()

    def _flush(self) -> None:
        self.steps.flush()
        if self.requests is not None:
            self.requests.flush()
        self.flushed = self.clock()

    def close(self) -> None:
        with self.lock:
            if self.requests is None:
                return
            self.requests.close()
            self.steps.close()
            self.requests = None
        self._write_run(self.cpu_share())


def write_run(requests_path: Path, run: dict, requests: list, steps: list[dict], start: float,
              cpu_share: dict | None = None) -> None:
    """generate's run folder at the end of the run: its requests in input order, its steps in submission order;
    `cpu_share`: what StepRecorder.cpu_share measured over the run."""
    writer = RunWriter(requests_path, run, start, lambda: cpu_share)
    for request in requests:
        writer.request(request)
    for step in sorted(steps, key=lambda s: s["submitted_s"]):
        writer.step(step)
    writer.close()
