"""Serving speed side by side in one run on this machine: fivefold's engine (continuous batching, chunked prefill,
paged KV cache) against transformers' `generate` with static batches on the same mixed-length requests, and
tp2 / pp2 worker layouts against tp1; TTFT and TPOT percentiles of each fivefold run.

The model is a random Llama built locally (no download); every request asks for its own number of tokens (end
tokens ignored), so the useful output is the same in every run. transformers pads each static batch of
--batch prompts on the left and generates until the batch's longest request is done; its tokens/s counts the
requested tokens only (what a client receives), so the padding and the tokens past a request's own max_tokens are
the static batch's waste. All requests arrive at once (an offline batch): TTFT includes the wait for a slot.
Beside wall seconds each single-process run reports its CPU seconds (time.process_time, one torch thread), which
the neighbours' load on a shared machine disturbs far less; worker layouts (tp2, pp2) have wall seconds only.

    .venv/bin/python bench/serve.py [--requests 32] [--batch 8,32] [--layouts tp1,tp2,pp2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)


def build_model(folder: Path):
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).eval()
    model.generation_config.eos_token_id = None  # every request runs to its own max_tokens
    model.save_pretrained(folder)
    return model


def request_set(count: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): prompts of 8-384 tokens, outputs of 8-128 tokens, mixed at random."""
    rng = random.Random(seed)
    return [([rng.randrange(1, MODEL["vocab_size"]) for _ in range(rng.randint(8, 384))], rng.randint(8, 128))
            for _ in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_transformers(model, requests, batch: int) -> dict:
    started, cpu_started = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for first in range(0, len(requests), batch):
            group = requests[first:first + batch]
            longest = max(len(ids) for ids, _ in group)
            ids = torch.zeros(len(group), longest, dtype=torch.long)
            mask = torch.zeros(len(group), longest, dtype=torch.long)
            for row, (prompt, _) in enumerate(group):  # left padding, as generate wants for a decoder
                ids[row, longest - len(prompt):] = torch.tensor(prompt)
                mask[row, longest - len(prompt):] = 1
            model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in group), do_sample=False,
                           pad_token_id=0)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    tokens = sum(n for _, n in requests)
    return {"run": f"transformers static batches of {batch}", "seconds": seconds, "tokens_per_s": tokens / seconds,
            "cpu_seconds": cpu_seconds}


def run_fivefold(folder: Path, requests, layout_name: str, limits) -> dict:
    from fivefold.serve.engine import Engine, Request
    from fivefold.serve.executor import make_executor
    from fivefold.serve.source import open_source
    from fivefold.spec.serve import ServeLayout

    degrees = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "replicas2": {"replicas": 2}}[layout_name]
    layout = ServeLayout(**degrees, dtype="fp32", kv_dtype="fp32", limits=limits)
    source = open_source(str(folder), None)
    executor = make_executor(source, layout)
    try:
        engine = Engine(executor, layout, (), source.spec.max_seq_len)
        batch = [Request(str(i), ids, n) for i, (ids, n) in enumerate(requests)]
        started, cpu_started = time.perf_counter(), time.process_time()
        for request in batch:
            request.arrival = started
            engine.add(request)
        while engine.busy:
            engine.step()
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        executor.close()
    ttft = [r.timings["ttft_s"] for r in batch]
    tpot = [r.timings["tpot_s"] for r in batch if r.timings["tpot_s"] is not None]
    tokens = sum(len(r.output_ids) for r in batch)
    assert tokens == sum(n for _, n in requests)
    return {"run": f"fivefold {layout_name}", "seconds": seconds, "tokens_per_s": tokens / seconds,
            # this process's CPU time: the whole run's only when no worker process computes (tp1)
            "cpu_seconds": cpu_seconds if layout.devices == 1 else None,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
            "tpot_p50_s": percentile(tpot, 0.5), "tpot_p90_s": percentile(tpot, 0.9),
            "preemptions": engine.preemptions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--batch", default="8,32", help="transformers' static batch sizes (comma-separated)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process (default: 1: on a "
                        "shared machine, OpenMP threads that wait for each other's cores make runs erratic)")
    parser.add_argument("--layouts", default="tp1,tp2,pp2", help="fivefold layouts to run (tp1 first)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-tokens-per-step", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of each, interleaved; the fastest counts (neighbours' load comes and goes)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()

    from fivefold.spec.serve import BatchLimits

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the worker processes read it (local.threads_per_worker)
    torch.set_num_threads(args.threads)
    limits = BatchLimits(max_batch=args.max_batch, max_tokens_per_step=args.max_tokens_per_step, kv_blocks=4096)
    requests = request_set(args.requests, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        model = build_model(folder)
        rounds = []
        for _ in range(args.rounds):
            rounds.append([run_transformers(model, requests, int(size)) for size in args.batch.split(",")]
                          + [run_fivefold(folder, requests, name, limits) for name in args.layouts.split(",")])
        rows = [min(runs, key=lambda row: row["seconds"]) for runs in zip(*rounds)]
    print(f"best of {args.rounds} interleaved rounds; {args.requests} requests: prompts 8-384 tokens, outputs "
          f"8-128 tokens, {sum(n for _, n in requests)} output tokens; model {MODEL['num_hidden_layers']} layers x {MODEL['hidden_size']}, torch threads "
          f"{torch.get_num_threads()}")
    hf_rows = len(args.batch.split(","))
    base = max(row["tokens_per_s"] for row in rows[:hf_rows])  # transformers' best static batch
    tp1 = rows[hf_rows]["tokens_per_s"]
    cpu_base = min(row["cpu_seconds"] for row in rows[:hf_rows])
    print(f"{'run':34} {'s':>7} {'tok/s':>8} {'vs best hf':>10} {'vs tp1':>6} {'CPU s':>6} {'vs hf CPU':>9} "
          f"{'TTFT p50/p90 s':>16} {'TPOT p50/p90 ms':>16}")
    for row in rows:
        cpu = (f"{row['cpu_seconds']:6.2f} {cpu_base / row['cpu_seconds']:9.2f}" if row["cpu_seconds"] is not None
               else f"{'-':>6} {'-':>9}")
        latency = (f"{row['ttft_p50_s']:7.2f}/{row['ttft_p90_s']:<7.2f} "
                   f"{1e3 * row['tpot_p50_s']:7.1f}/{1e3 * row['tpot_p90_s']:<7.1f}" if "ttft_p50_s" in row else "")
        print(f"{row['run']:34} {row['seconds']:7.2f} {row['tokens_per_s']:8.1f} {row['tokens_per_s'] / base:10.2f} "
              f"{row['tokens_per_s'] / tp1:6.2f} {cpu}  {latency}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
