"""DiLoCo against synchronous DP across an emulated slow link, predicted and measured.

Two groups of one CPU process each (dp 2, one outer group per rank), so every byte of data-parallel
synchronisation crosses the link. The link: a network namespace of its own (`unshare -n`, root) whose
loopback carries a token-bucket qdisc (tc tbf, RATE, MTU 1500 so a packet fits the bucket). Both ranks'
traffic goes through that one queue, so a link of RATE is a GroupLink whose per-rank share is RATE / 2.

Per mode (sync, DiLoCo H, Streaming DiLoCo) the same run goes twice: without the qdisc (compute and
loopback only) and with it. Predicted step time = the unthrottled step time + the outer or gradient
all-reduce on that link by the cost model's rule (cost/comm.py all_reduce_time: bytes / bandwidth +
latency), amortised over the steps (bytes from the run's own dp_sync_bytes records). Measured = the
throttled run's mean step time (first step left out).

    python bench/diloco_link.py [--rate-mbit 20] [--steps 17] [--sync-every 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from fivefold.cost.comm import GroupLink, all_reduce_time  # noqa: E402
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster  # noqa: E402

MODES = {"sync DP": {}, "DiLoCo": {"dp_sync": "diloco"},
         "Streaming DiLoCo": {"dp_sync": "diloco", "fragments": 2, "overlap": 1}}


def run_modes(folder: Path, steps: int, sync_every: int, tag: str) -> dict[str, list[dict]]:
    from fivefold.runtime import RunConfig, launch

    plan = Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x1xcpu+1x1xcpu"),
                train=TrainSpec(seq_len=64, global_batch=8, dtype="fp32"), dp=2, micro_batch=4)
    configs = []
    for name, flags in MODES.items():
        extra = {"sync_every": sync_every, **flags} if flags else {}
        configs.append(RunConfig(plan.to_toml(), steps=steps, device="cpu", show_progress=False,
                                 metrics_file=str(folder / f"{tag}-{len(configs)}.jsonl"), **extra))
    launch(configs, 2)
    return {name: [json.loads(line) for line in Path(config.metrics_file).read_text().splitlines()]
            for name, config in zip(MODES, configs)}


def mean_step(records: list[dict]) -> float:
    timed = records[1:]
    return sum(r["step_time_s"] for r in timed) / len(timed)


def link_seconds(records: list[dict], link: GroupLink) -> float:
    """Seconds per step the link adds: each step's all-reduce of the buffer its dp_sync_bytes counts
    (ring over 2 ranks: a rank sends the buffer once), first step left out like the measurement."""
    timed = records[1:]
    return sum(all_reduce_time(r["dp_sync_bytes"], link) for r in timed if r["dp_sync_bytes"]) / len(timed)


def inside(args: argparse.Namespace) -> int:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "link", "set", "lo", "mtu", "1500"], check=True)
    folder = Path(tempfile.mkdtemp(prefix="diloco-link-"))
    try:
        free = run_modes(folder, args.steps, args.sync_every, "free")
        subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{args.rate_mbit}mbit",
                        "burst", "20kb", "latency", "2s"], check=True)
        slow = run_modes(folder, args.steps, args.sync_every, "slow")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rate = args.rate_mbit * 1e6 / 8
    link = GroupLink(size=2, nodes=2, members_per_node=1, intra_bandwidth=float("inf"), network_bandwidth=rate / 2,
                     latency=args.latency_ms / 1e3)
    print(f"tiny (hidden 64, 2 layers), dp 2 = 2 groups of 1 CPU process, seq 64, batch 8, {args.steps} steps, "
          f"link tc tbf {args.rate_mbit} Mbit/s shared by both directions, H = {args.sync_every}")
    print(f"{'mode':<18} {'bytes/step':>12} {'free s':>8} {'predicted s':>12} {'measured s':>11} {'error':>7}")
    rows = {}
    for name in MODES:
        predicted = mean_step(free[name]) + link_seconds(slow[name], link)
        measured = mean_step(slow[name])
        sent = sum(r["dp_sync_bytes"] for r in slow[name]) / len(slow[name])
        rows[name] = (predicted, measured)
        print(f"{name:<18} {sent:>12,.0f} {mean_step(free[name]):>8.3f} {predicted:>12.3f} {measured:>11.3f} "
              f"{(predicted - measured) / measured:>+7.1%}")
    speedup = rows["sync DP"][1] / rows["DiLoCo"][1]
    print(f"DiLoCo step {speedup:.2f}x faster than sync DP on this link (predicted "
          f"{rows['sync DP'][0] / rows['DiLoCo'][0]:.2f}x)")
    worst = max(abs(p - m) / m for p, m in rows.values())
    print(f"worst prediction error {worst:.1%} (target: within 20%)")
    return 0 if worst <= 0.2 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--latency-ms", type=float, default=0.2, help="per collective step on the emulated link")
    parser.add_argument("--steps", type=int, default=17)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        return inside(args)
    # A network namespace of our own: its loopback is the slow link, the host's is untouched.
    return subprocess.run(["unshare", "-n", sys.executable, __file__, "--inside", *sys.argv[1:]]).returncode


if __name__ == "__main__":
    sys.exit(main())
