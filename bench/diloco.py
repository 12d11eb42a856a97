"""Convergence of DiLoCo and Streaming DiLoCo against synchronous DP at equal tokens, tuned as Charles et al. tune.

`small` (8 layers, hidden 256, 5.9M parameters) on the built-in corpus, 2 outer groups of one CPU process each,
the same global batch every step for every run. The protocol follows Charles et al. 2025 ("Scaling Laws for
DiLoCo", arXiv:2503.09799, section 3): inner AdamW with linear warmup and cosine decay to 5% of the peak lr; outer
SGD with Nesterov momentum 0.9 and a constant outer lr, which they sweep over {0.2, 0.4, 0.6, 0.8, 1.0} and find best at 0.6 for
M = 2 at every size (their Figure 7; the default here, --outer-lrs runs more of the grid), the best run kept per H; the loss that counts is the evaluation loss on held-out text (their C4 validation set;
here 1,000 stories the corpus's grammar draws with another seed, which no run trains on). Besides their grid,
every H also runs plain averaging (outer lr 1, momentum 0).

Runs: DDP; DiLoCo H in {5, 20, 50} x the outer settings above; Streaming DiLoCo (H 20, 4 fragments, overlap 1)
at H 20's best outer setting. Each run's metrics stay in --work (a rerun skips the runs already there), so the sweep
can be stopped and continued. Prints per run the final training loss (mean of the last 10 steps), the final
held-out loss, both against DDP's (and the held-out difference in nats: the paper's +0.7% at 35M is +0.023), the
wall time and the dp bytes sent (sum of dp_sync_bytes, rank 0); the best
per H against the gap Table 4 of the paper gives at M = 2 for its smallest model (cost/diloco.py loss_gap).
Writes the curves of DDP, the best run per H and Streaming to --out, and of DDP and the best momentum-0.9 run per H
beside it (..._momentum09.png).

    python bench/diloco.py [--steps 200] [--work out/bench_diloco] [--out docs/images/diloco_convergence.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from fivefold.cost.diloco import loss_gap  # noqa: E402
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster  # noqa: E402

SYNC_EVERY = (5, 20, 50)
PAPER_GRID = "0.2,0.4,0.6,0.8,1.0"  # Charles et al. 2025, section 3.1: their outer lr sweep
PAPER_BEST = "0.6"  # ibid., Figure 7: the best of that grid for M = 2 at every model size (H = 30)
PAPER_MOMENTUM = 0.9  # ibid., section 3: "We use a momentum term of 0.9"
STREAMING = {"sync_every": 20, "fragments": 4, "overlap": 1}
TAIL = 10  # steps averaged for the final training loss
MIN_LR_SHARE = 0.05  # ibid., section 3: cosine decay "to 5% of the peak learning rate"


def run_name(flags: dict) -> str:
    if not flags:
        return "DDP"
    kind = "Streaming" if flags.get("fragments", 1) > 1 else "DiLoCo"
    extra = f" P={flags['fragments']} T={flags['overlap']}" if kind == "Streaming" else ""
    return f"{kind} H={flags['sync_every']}{extra} lr={flags['outer_lr']:g} m={flags['outer_momentum']:g}"


def heldout_text(path: Path) -> Path:
    """1,000 stories of the built-in grammar drawn with seed 1 (the training corpus is seed 0)."""
    from fivefold.data.corpus import builtin_documents

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(builtin_documents(1000, seed=1)) + "\n")
    return path


def metrics_file(work: Path, flags: dict) -> Path:
    return work / (run_name(flags).replace(" ", "_").replace("=", "") + ".jsonl")


def read_run(work: Path, flags: dict) -> dict:
    """A finished run's records, and its wall seconds from its records' clock (the step ends)."""
    records = [json.loads(line) for line in metrics_file(work, flags).read_text().splitlines()]
    seconds = records[-1]["wall_time"] - records[0]["wall_time"] + records[0]["step_time_s"]
    return {"name": run_name(flags), "flags": flags, "seconds": seconds, "records": records}


def train(runs: list[dict], args: argparse.Namespace, work: Path) -> list[dict]:
    """The runs (DiLoCo flags; {} = DDP) not finished in `work` yet, in one launch (one start-up for all)."""
    from fivefold.runtime import RunConfig, launch

    def finished(flags: dict) -> bool:
        file = metrics_file(work, flags)
        return file.exists() and len(file.read_text().splitlines()) == args.steps
    plan = Plan(model=PRESETS["small"], cluster=parse_cluster("1x1xcpu+1x1xcpu"),
                train=TrainSpec(seq_len=args.seq_len, global_batch=args.global_batch, dtype="fp32"), dp=2,
                micro_batch=args.global_batch // 2)
    heldout = str(heldout_text(work / "heldout.txt"))
    configs = [RunConfig(plan.to_toml(), steps=args.steps, lr=args.lr, warmup_steps=max(1, args.steps // 20),
                         min_lr=args.lr * MIN_LR_SHARE, device="cpu", show_progress=False,
                         metrics_file=str(metrics_file(work, flags)), metrics_every=args.steps, eval_data=heldout,
                         eval_every=args.eval_every, eval_batches=args.eval_batches,
                         **({"dp_sync": "diloco", **flags} if flags else {}))
               for flags in runs if not finished(flags)]
    if configs:
        launch(configs, 2)
    return [read_run(work, flags) for flags in runs]


def final_train(run: dict) -> float:
    return sum(r["loss"] for r in run["records"][-TAIL:]) / TAIL


def final_eval(run: dict) -> float:
    return [r["eval_loss"] for r in run["records"] if "eval_loss" in r][-1]


def sweep(args: argparse.Namespace, work: Path) -> tuple[dict, dict[int, list[dict]], dict]:
    """DDP and the paper's setting for every H, plain averaging per H, then Streaming at H 20's best outer
    setting (in this order, so that a sweep cut short by the machine still has one run of each kind)."""
    paper = [{"sync_every": every, "outer_lr": lr, "outer_momentum": PAPER_MOMENTUM}
             for every in SYNC_EVERY for lr in map(float, args.outer_lrs.split(","))]
    plain = [{"sync_every": every, "outer_lr": 1.0, "outer_momentum": 0.0} for every in SYNC_EVERY]
    ddp, *diloco = train([{}, *paper, *plain], args, work)
    by_h = {every: [r for r in diloco if r["flags"]["sync_every"] == every] for every in SYNC_EVERY}
    best = min(by_h[STREAMING["sync_every"]], key=final_eval)["flags"]
    streaming, = train([{**STREAMING, "outer_lr": best["outer_lr"], "outer_momentum": best["outer_momentum"]}],
                       args, work)
    return ddp, by_h, streaming


def plot(curves: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (train_axis, eval_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in curves:
        losses = [r["loss"] for r in run["records"]]
        smooth = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        line, = train_axis.plot([r["step"] for r in run["records"]], smooth, label=run["name"], linewidth=1.3)
        evals = [(r["step"], r["eval_loss"]) for r in run["records"] if "eval_loss" in r]
        eval_axis.plot(*zip(*evals), "o-", color=line.get_color(), label=run["name"], linewidth=1.3)
    train_axis.set_ylabel("training loss (mean of the last 10 steps)")
    eval_axis.set_ylabel("held-out loss (stories of another seed)")
    for axis in (train_axis, eval_axis):
        axis.set_xlabel("step (equal tokens in every run)")
        axis.set_yscale("log")
        axis.grid(alpha=0.3, which="both")
    eval_axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--outer-lrs", default=PAPER_BEST,
                        help=f"outer lrs tried with momentum 0.9 (default {PAPER_BEST}: the paper's best for M = 2; "
                             f"its whole grid: {PAPER_GRID})")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--work", default=str(Path(__file__).resolve().parents[1] / "out" / "bench_diloco"))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs/images/diloco_convergence.png"))
    args = parser.parse_args()
    work = Path(args.work) / f"steps{args.steps}"
    work.mkdir(parents=True, exist_ok=True)
    ddp, by_h, streaming = sweep(args, work)
    ddp_train, ddp_eval = final_train(ddp), final_eval(ddp)
    ddp_bytes = sum(r["dp_sync_bytes"] for r in ddp["records"])
    print(f"small ({PRESETS['small'].num_params():,} parameters), 2 groups, {args.steps} steps of {args.global_batch} "
          f"x {args.seq_len} tokens; paper gap at M = 2 (35M, Table 4): {loss_gap(35e6, 2):+.2%}")
    print(f"{'run':<34} {'train loss':>10} {'vs DDP':>8} {'held-out':>9} {'vs DDP':>8} {'nats':>7} {'bytes vs DDP':>12} "
          f"{'wall':>6}")
    for run in [ddp, *(r for runs in by_h.values() for r in runs), streaming]:
        sent = sum(r["dp_sync_bytes"] for r in run["records"])
        ratio = "1" if run is ddp else f"1/{ddp_bytes / sent:,.0f}" if sent else "0"
        print(f"{run['name']:<34} {final_train(run):>10.4f} {final_train(run) / ddp_train - 1:>+8.1%} "
              f"{final_eval(run):>9.4f} {final_eval(run) / ddp_eval - 1:>+8.1%} {final_eval(run) - ddp_eval:>+7.3f} "
              f"{ratio:>12} {run['seconds']:>5.0f}s")
    best = [min(runs, key=final_eval) for runs in by_h.values()]
    print("best per H (held-out): " + ", ".join(f"{r['name']} {final_eval(r) / ddp_eval - 1:+.1%}" for r in best))
    plot([ddp, *best, streaming], Path(args.out),
         f"small, built-in corpus, 2 groups, {args.steps} steps: DDP vs the best outer setting run per H, "
         "and Streaming at H 20's")
    paper = [min((r for r in runs if r["flags"]["outer_momentum"] == PAPER_MOMENTUM), key=final_eval)
             for runs in by_h.values()]
    paper_out = Path(args.out).with_name(Path(args.out).stem + "_momentum09.png")
    plot([ddp, *paper], paper_out, f"the same, with the paper's outer Nesterov momentum 0.9 (best outer lr run per H)")
    print(f"plots: {args.out}, {paper_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
