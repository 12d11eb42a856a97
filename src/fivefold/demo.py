"""The README's main job on an embedded default: plan, simulate, then train for real on CPU.

1. plan Llama 3 70B on 64 H100s (what the planner does at scale),
2. plan the tiny model on 4 CPU worker processes, fixed to a 2 x 2 layout (dp 2 x pp 2),
3. simulate that plan and draw its timeline,
4. train it for a few dozen steps with torch.distributed (gloo) and show the loss falling.
Everything lands in out/demo/ (or the folder given as the first argument).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console

from fivefold.cli import main as fivefold


def run(argv: list[str]) -> None:
    console = Console(highlight=False)
    console.rule(f"[bold]fivefold {' '.join(argv)}")
    code = fivefold(argv)
    if code != 0:
        raise SystemExit(code)


def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    out = Path(args[0] if args else "out/demo")
    out.mkdir(parents=True, exist_ok=True)
    plan_file, metrics_file = out / "plan.toml", out / "metrics.jsonl"
    metrics_file.unlink(missing_ok=True)

    run(["plan", "--model", "llama3-70b", "--cluster", "8x8xH100-SXM", "--seq-len", "8192",
         "--global-batch", "128", "--top", "5"])
    run(["plan", "--model", "tiny", "--cluster", "1x4xcpu", "--seq-len", "64", "--global-batch", "16",
         "--dp", "2", "--pp", "2", "--top", "3", "--out", str(plan_file)])
    run(["simulate", "--plan", str(plan_file), "--out-dir", str(out)])
    run(["train", "--plan", str(plan_file), "--steps", "40", "--lr", "1e-2", "--metrics-file", str(metrics_file)])

    losses = [json.loads(line)["loss"] for line in metrics_file.read_text().splitlines() if line.strip()]
    console = Console(highlight=False)
    console.rule("[bold]result")
    console.print(f"loss fell from {losses[0]:.3f} (step 1) to {losses[-1]:.3f} (step {len(losses)}); "
                  f"plan {plan_file}, timeline {out / 'timeline.png'}, metrics {metrics_file}")
    if not losses[-1] < losses[0]:
        console.print("[red]the loss did not fall[/red]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
