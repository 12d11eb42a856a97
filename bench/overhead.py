"""fivefold's single-process step time over a plain PyTorch loop, same model, same batches.

Both run in this one process, alternating, so they share the machine's state; each round trains a
fresh model for --steps steps and takes the median time of every step but the first (warm-up); the
medians keep a busy neighbour on a shared machine from deciding the result. The plain loop is what one
would write by hand (nanoGPT style): forward, cross-entropy, backward, clip_grad_norm_, AdamW. fivefold
adds its plan machinery: a 1-process DeviceMesh, the stage/parallelism plumbing, the global-norm
clipping, the loss all-reduce path, metrics and a JSON line per step. Target: ratio <= 1.05.

    .venv/bin/python bench/overhead.py [--model small] [--seq-len 128] [--global-batch 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fivefold.data import GlobalBatchLoader, default_dataset
from fivefold.models import build_model, init_weights
from fivefold.runtime import RunConfig, train
from fivefold.runtime.launch import free_port
from fivefold.spec import Plan, TrainSpec, parse_cluster, parse_model


def plain_step_time(plan: Plan, steps: int, seed: int, lr: float) -> float:
    """Median step time (s) of a hand-written loop over the same model and batches, first step excluded."""
    model = build_model(plan.model, device="meta").to_empty(device="cpu")
    init_weights(model, seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95))
    loader = GlobalBatchLoader(default_dataset(), plan.train.seq_len, plan.train.global_batch, seed)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        batch = loader.next_batch()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def fivefold_step_time(plan: Plan, steps: int, seed: int, lr: float, metrics_file: str) -> float:
    """Median step time (s) of fivefold's loop, from its metrics file, first step excluded."""
    train(RunConfig(plan.to_toml(), steps=steps, seed=seed, lr=lr, device="cpu", show_progress=False,
                    metrics_file=metrics_file))
    records = [json.loads(line) for line in Path(metrics_file).read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="steps per round (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    # A world of one process: what torchrun would set for `--nproc-per-node 1`.
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    # One micro-batch of the whole batch, as the plain loop does.
    plan = Plan(model=parse_model(args.model), cluster=parse_cluster("1x1xcpu"),
                train=TrainSpec(seq_len=args.seq_len, global_batch=args.global_batch, dtype="fp32"),
                micro_batch=args.global_batch)
    print(f"model {plan.model.name} ({plan.model.num_params() / 1e6:.1f}M params), seq {args.seq_len}, "
          f"batch {args.global_batch}, {torch.get_num_threads()} threads, {args.rounds} rounds of {args.steps} steps")
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            plain = plain_step_time(plan, args.steps, seed=round_index, lr=1e-3)
            ours = fivefold_step_time(plan, args.steps, round_index, 1e-3, str(Path(folder) / f"r{round_index}.jsonl"))
            ratios.append(ours / plain)
            print(f"round {round_index + 1}: plain {plain * 1e3:7.1f} ms/step  fivefold {ours * 1e3:7.1f} ms/step  "
                  f"ratio {ratios[-1]:.3f}", flush=True)
    median = statistics.median(ratios)
    print(f"median ratio fivefold / plain: {median:.3f} (target <= 1.05)")
    return 0 if median <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
