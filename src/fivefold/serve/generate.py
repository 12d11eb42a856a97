"""`fivefold generate`: every prompt of a JSON-lines file through the engine at once (continuous batching), the
completions written in input order with their timings."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from fivefold.errors import SpecError, require
from fivefold.serve.engine import Engine, Request, check_request
from fivefold.serve.record import (StepRecorder, arrivals_queue, check_record_flags, launch_record, predict_run,
                                   trace_prompts, write_run)
from fivefold.serve.sampling import SamplingParams
from fivefold.serve.source import TextCodec


def read_prompts(path: str, codec: TextCodec | None, vocab: int) -> list[list[int]]:
    """Token ids of each line's `prompt` (text, with the folder's tokenizer) or `prompt_ids`."""
    file = Path(path)
    if not file.is_file():
        raise SpecError("--input", path, "no such file; give a JSON-lines file with one {\"prompt\": ...} or "
                                         "{\"prompt_ids\": [...]} per line")
    prompts = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError:
            raise SpecError(where, line[:40], "not a JSON object; write {\"prompt\": \"text\"} or "
                                              "{\"prompt_ids\": [1, 2, 3]}") from None
        if not isinstance(record, dict) or ("prompt" in record) == ("prompt_ids" in record):
            raise SpecError(where, line[:40], "needs exactly one of \"prompt\" (text) or \"prompt_ids\" (token ids)")
        if "prompt" in record:
            require(isinstance(record["prompt"], str), f"{where}:prompt", record["prompt"], "must be a string")
            require(codec is not None, f"{where}:prompt", record["prompt"][:20],
                    "this model folder has no tokenizer; give prompt_ids")
            ids = codec.encode(record["prompt"])
        else:
            ids = record["prompt_ids"]
            require(isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids),
                    f"{where}:prompt_ids", str(ids)[:40], "must be a list of integer token ids")
            bad = [i for i in ids if not 0 <= i < vocab]
            require(not bad, f"{where}:prompt_ids", bad[:3], f"token ids must be in [0, {vocab})")
        require(len(ids) > 0, f"{where}:prompt", "", "is empty")
        prompts.append(ids)
    require(bool(prompts), "--input", path, "holds no prompt")
    return prompts


def check_generate_args(args: argparse.Namespace) -> None:
    require(args.max_tokens >= 1, "--max-tokens", args.max_tokens, "must be at least 1")
    trace = getattr(args, "trace", None)
    if bool(args.input) == bool(trace):
        raise SpecError("--input/--trace", args.input or trace, "give exactly one: a prompts file or a request trace")
    check_record_flags(args)
    from fivefold.serve.options import check_sampling

    check_sampling(args.temperature, args.top_p)


def run_generate(args: argparse.Namespace) -> dict | None:
    """Check everything, then generate; returns a summary (requests, tokens, seconds, tokens/s), or None on a
    torchrun rank other than 0 (it computed its share; rank 0 writes the output)."""
    from fivefold.batching import Scheduler
    from fivefold.outputs import check_output_file, make_parents
    from fivefold.serve.options import layout_from_serve_args
    from fivefold.serve.source import open_codec, open_source

    check_generate_args(args)
    source = open_source(args.from_hf, args.checkpoint)
    layout = layout_from_serve_args(args, source.spec)
    from fivefold.serve.executor import make_executor

    if args.torchrun_worker and os.environ.get("RANK", "0") != "0":  # a worker rank: its share of the model only
        make_executor(source, layout, args.device, args.memory_window, torchrun=True)
        return None
    codec = open_codec(source)
    arrivals: list[float] | None = None
    if getattr(args, "trace", None):  # random prompts of the trace's lengths, each exactly its output length
        prompts, max_tokens, arrivals = trace_prompts(args.trace, source.spec.vocab, args.seed)
    else:
        prompts = read_prompts(args.input, codec, source.spec.vocab)
        max_tokens = [args.max_tokens] * len(prompts)
    check_output_file(args.output, "--output", "out.jsonl")
    probe = Scheduler(layout.limits)
    for number, (ids, count) in enumerate(zip(prompts, max_tokens), 1):
        try:
            check_request(len(ids), count, source.spec.max_seq_len, probe)
        except SpecError as exc:
            raise SpecError(f"{args.input or args.trace}:{number}:{exc.field}", exc.value, exc.fix) from None
    launch = launch_record(args, source.spec, layout, "generate")  # checked before any worker starts
    run = predict_run(source.spec, layout, launch, prompts, max_tokens, arrivals) if launch is not None else None

    from fivefold.runtime.metrics import Progress

    print_torchrun_line("generate", args, layout)
    started = time.perf_counter()
    executor = make_executor(source, layout, args.device, args.memory_window, args.torchrun_worker)
    if run is not None:
        executor = StepRecorder(executor)
    try:
        engine = Engine(executor, layout, eos_ids=() if args.ignore_eos or arrivals else source.eos_ids,
                        max_context=source.spec.max_seq_len)
        if run is not None:
            executor.attach(engine)
        requests = [Request(str(i), ids, count,
                            SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, key=i))
                    for i, (ids, count) in enumerate(zip(prompts, max_tokens))]
        progress = Progress(len(requests), f"generating {len(requests)} completions with {source.name} "
                            f"(tp {layout.tp} x pp {layout.pp} x {layout.replicas} replicas)", stream=sys.stderr)
        loaded = time.perf_counter()
        if run is not None:
            executor.started()  # the CPU share over the requests, not the model's loading
        pending = arrivals_queue(engine, requests, arrivals, loaded)
        done, shown = 0, 0.0
        while engine.busy or pending:
            pending.admit()
            engine.step()
            finished = sum(r.finish_reason is not None for r in requests)
            # A bar on a terminal follows every request; a log gets a line every 2 s and the last one.
            if finished != done and (progress.bar is not None or finished == len(requests)
                                     or time.perf_counter() - shown > 2.0):
                done, shown = finished, time.perf_counter()
                _progress(progress, done, engine, loaded)
        elapsed = time.perf_counter() - loaded
        share = executor.cpu_share() if run is not None else None
        progress.close()
    finally:
        executor.close()
    if run is not None:
        write_run(make_parents(args.metrics_file, "--metrics-file"), run, requests, executor.steps, loaded, share)
    out = make_parents(args.output, "--output")
    with out.open("w") as handle:
        for request in requests:
            record = {"index": int(request.request_id), "prompt_tokens": len(request.prompt_ids),
                      "completion_ids": request.output_ids, "finish_reason": request.finish_reason,
                      "timings": request.timings}
            if codec is not None:
                record["text"] = codec.decode(request.output_ids)
            handle.write(json.dumps(record) + "\n")
    tokens = sum(len(r.output_ids) for r in requests)
    return {"requests": len(requests), "completion_tokens": tokens, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0, "preemptions": engine.preemptions,
            "load_seconds": loaded - started, "output": str(out)}


def print_torchrun_line(verb: str, args: argparse.Namespace, layout) -> None:
    """As `fivefold train`: the line that runs this layout over --nnodes machines (torchrun on each)."""
    if layout.devices > 1 and not args.torchrun_worker:
        from fivefold.runtime.launch import torchrun_command

        command = torchrun_command(None, getattr(args, "worker_flags", []), args.nnodes,
                                   layout.devices // args.nnodes, verb)
        print(f"on several machines, run on each: {command}", file=sys.stderr, flush=True)


def _progress(progress, done: int, engine: Engine, since: float) -> None:
    seconds = time.perf_counter() - since
    rate = engine.generated_tokens / seconds if seconds > 0 else 0.0
    record_line = f"{done}/{progress.total} done  {engine.generated_tokens} tokens  {rate:,.1f} tok/s"
    if progress.bar is not None:
        progress.bar.update(progress.task, completed=done, figures=f"{rate:,.1f} tok/s")
    else:
        print(record_line, file=progress.stream, flush=True)
