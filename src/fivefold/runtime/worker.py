"""Entry point for torchrun on several machines:

    torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m fivefold.runtime.worker --plan plan.toml --steps 100 --metrics-file runs/a/metrics.jsonl

Each process reads the plan, checks it against the world torchrun started, and trains its rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from fivefold.errors import FivefoldError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fivefold.runtime.worker",
                                     description="one worker of `fivefold train` (started by torchrun)")
    parser.add_argument("--plan", required=True, help="plan TOML file")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--data", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--metrics-file", default=None)
    parser.add_argument("--json", action="store_true", help="rank 0 prints a JSON summary at the end")
    args = parser.parse_args(argv)

    from fivefold.runtime.launch import check_runnable
    from fivefold.runtime.train import RunConfig, train
    from fivefold.spec import load_plan

    import torch

    try:
        plan = load_plan(args.plan)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
        check_runnable(plan, world, device, gpus=torch.cuda.device_count(),
                       local_nproc=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    except FivefoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = RunConfig(plan_toml=plan.to_toml(), steps=args.steps, seed=args.seed, lr=args.lr,
                       warmup_steps=args.warmup_steps, grad_clip=args.grad_clip, data=args.data,
                       tokenizer=args.tokenizer, device=args.device, metrics_file=args.metrics_file,
                       progress_to_stderr=args.json)
    summary = train(config)
    import torch.distributed as dist

    dist.destroy_process_group()
    if summary and args.json:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
