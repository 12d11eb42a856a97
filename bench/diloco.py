"""Convergence of DiLoCo and Streaming DiLoCo against synchronous DP at equal tokens, and the bytes each sends.

`small` (8 layers, hidden 256, 5.9M parameters) on the built-in corpus, 2 outer groups of one CPU process
each, the same global batch every step for every run: synchronous DP (DDP), DiLoCo with H in {5, 20, 50}
(outer SGD lr 0.7, Nesterov momentum 0.9: the defaults; --outer-lr / --outer-momentum change them) and Streaming DiLoCo (H 20, 4 fragments, overlap 1).
Prints the final loss (mean of the last 10 steps) against DDP's, the gap Charles et al. 2025 report at M = 2
for their smallest model (cost/diloco.py loss_gap), and the dp bytes sent (sum of the runs' dp_sync_bytes);
writes the loss curves to docs/images/diloco_convergence.png.

    python bench/diloco.py [--steps 300] [--seq-len 128] [--global-batch 8] [--out docs/images/diloco_convergence.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from fivefold.cost.diloco import loss_gap  # noqa: E402
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster  # noqa: E402

RUNS = {"DDP": {}, "DiLoCo H=5": {"dp_sync": "diloco", "sync_every": 5},
        "DiLoCo H=20": {"dp_sync": "diloco", "sync_every": 20},
        "DiLoCo H=50": {"dp_sync": "diloco", "sync_every": 50},
        "Streaming H=20 P=4 T=1": {"dp_sync": "diloco", "sync_every": 20, "fragments": 4, "overlap": 1}}
TAIL = 10  # steps averaged for the final loss


def train_all(steps: int, seq_len: int, global_batch: int, lr: float, outer: dict, folder: Path
              ) -> dict[str, list[dict]]:
    from fivefold.runtime import RunConfig, launch

    plan = Plan(model=PRESETS["small"], cluster=parse_cluster("1x1xcpu+1x1xcpu"),
                train=TrainSpec(seq_len=seq_len, global_batch=global_batch, dtype="fp32"), dp=2,
                micro_batch=global_batch // 2)
    configs = [RunConfig(plan.to_toml(), steps=steps, lr=lr, warmup_steps=max(1, steps // 20), device="cpu",
                         show_progress=False, metrics_file=str(folder / f"run{i}.jsonl"), metrics_every=steps, **flags,
                         **(outer if flags else {}))
               for i, flags in enumerate(RUNS.values())]
    launch(configs, 2)
    return {name: [json.loads(line) for line in Path(c.metrics_file).read_text().splitlines()]
            for name, c in zip(RUNS, configs)}


def plot(records: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for name, rows in records.items():
        losses = [r["loss"] for r in rows]
        smooth = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        axis.plot([r["step"] for r in rows], smooth, label=name, linewidth=1.4)
    axis.set_xlabel("step (equal tokens in every run)")
    axis.set_ylabel("training loss (mean of the last 10 steps)")
    axis.set_title("small on the built-in corpus, 2 groups: synchronous DP vs DiLoCo")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs/images/diloco_convergence.png"))
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--records", default=None, help="also write every run's metrics records here (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as folder:
        records = train_all(args.steps, args.seq_len, args.global_batch, args.lr,
                            {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}, Path(folder))
    if args.records:
        Path(args.records).write_text(json.dumps(records))
    plot(records, Path(args.out))
    gap = loss_gap(35e6, 2)  # the smallest model of Charles et al. 2025, M = 2
    ddp = sum(r["loss"] for r in records["DDP"][-TAIL:]) / TAIL
    ddp_bytes = sum(r["dp_sync_bytes"] for r in records["DDP"])
    print(f"small ({PRESETS['small'].num_params():,} parameters), 2 groups, {args.steps} steps of "
          f"{args.global_batch} x {args.seq_len} tokens, outer lr {args.outer_lr}, outer momentum "
          f"{args.outer_momentum}; paper gap at M = 2 (35M): {gap:+.1%}")
    print(f"{'run':<24} {'final loss':>10} {'vs DDP':>8} {'dp bytes sent':>15} {'bytes vs DDP':>13}")
    for name, rows in records.items():
        final = sum(r["loss"] for r in rows[-TAIL:]) / TAIL
        sent = sum(r["dp_sync_bytes"] for r in rows)
        ratio = "1" if name == "DDP" else f"1/{ddp_bytes / sent:,.0f}" if sent else "0"
        print(f"{name:<24} {final:>10.4f} {(final - ddp) / ddp:>+8.2%} {sent:>15,.0f} {ratio:>13}")
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
