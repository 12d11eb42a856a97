"""Measured, not only predicted: the plan for a mixed cluster against the plan that assumes equal ranks.

The slow devices are made on this CPU with the test-only knob FIVEFOLD_SLOW_DEVICES (runtime/slowdown.py:
every transformer block on them sleeps so it takes FACTOR times its CPU time) and described to the
planner as a group with `speed=1/FACTOR`. Per scenario (what the search may choose):

    aware  the planner's best plan on the mixed cluster (uneven layers and/or micro-batches per replica,
           placement chosen by the cost model);
    naive  the planner's best plan on the same cluster described as homogeneous (even split, identity
           placement), run on the same slowed devices.

Both run with fivefold.runtime.launch in one launch, alternating (naive, aware, naive, ...) so they share
the machine's state; each run's step time is the median of its steps after the first, and the result the
median over rounds. The predicted step times are the simulator's replay of each plan on the mixed cluster
(with the cost model's durations), so the measured ratio naive / aware can be held against the predicted
one. The CPU catalog entry is a placeholder, so absolute predictions are rough; the ratio is the claim.

    .venv/bin/python bench/hetero.py [--world 2] [--factor 3] [--model small] [--rounds 3] [--steps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from fivefold.planner import Choices, search  # noqa: E402
from fivefold.planner.render import _work_split  # noqa: E402
from fivefold.runtime import RunConfig, launch  # noqa: E402
from fivefold.runtime.slowdown import ENV  # noqa: E402
from fivefold.sim import simulate_plan  # noqa: E402
from fivefold.spec import Plan, TrainSpec, parse_cluster, parse_model  # noqa: E402

# name -> what the search may choose. The runtime has no context parallelism; the pipeline keeps to 1F1B
# because the knob does not slow the separate weight-gradient pass of the zero-bubble schedules.
SCENARIOS = {
    "replicas": Choices(cp=1, tp=1, pp=1),
    "pipeline": Choices(cp=1, tp=1, dp=1, schedule="1f1b"),
}
NIC = "nic=40Gb/s"  # loopback between processes is fast; the catalog's 10 Gb/s CPU NIC would overstate sends


def clusters(world: int, factor: float) -> tuple[str, str, str]:
    """(mixed, the same described as homogeneous, the knob's setting): the second half is slow."""
    half = world // 2
    mixed = f"1x{half}xcpu:{NIC}+1x{half}xcpu:{NIC},speed={1 / factor:.6g}"
    same = f"1x{half}xcpu:{NIC}+1x{half}xcpu:{NIC}"
    knob = ",".join(f"{device}:{factor:g}" for device in range(half, world))
    return mixed, same, knob


def predicted_step(plan: Plan) -> float:
    """The simulator's step time (with uneven replicas it replays the one that finishes last)."""
    return simulate_plan(plan).step_time_s


def plans_for(model, mixed, same, train: TrainSpec, choices: Choices) -> tuple[Plan, Plan]:
    aware = search(model, mixed, train, choices, top=1).candidates[0].plan
    naive = search(model, same, train, choices, top=1).candidates[0].plan
    return dataclasses.replace(naive, cluster=mixed), aware  # the naive layout, on the real hardware


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="processes; the second half is slow (default 2)")
    parser.add_argument("--factor", type=float, default=3.0, help="how much slower the slow half is (default 3)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per run; the first is left out")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="default: all")
    args = parser.parse_args()
    if args.world < 2 or args.world % 2:
        parser.error("--world must be an even number >= 2")

    model = parse_model(args.model)
    train = TrainSpec(seq_len=args.seq_len, global_batch=args.global_batch, dtype="fp32")
    mixed_text, same_text, knob = clusters(args.world, args.factor)
    mixed, same = parse_cluster(mixed_text), parse_cluster(same_text)
    scenarios = {name: plans_for(model, mixed, same, train, SCENARIOS[name])
                 for name in (args.scenario or list(SCENARIOS))}
    print(f"{model.name}, seq {args.seq_len}, global batch {args.global_batch}, fp32, {args.world} CPU processes; "
          f"{ENV}={knob} (cluster {mixed_text})")
    free = search(model, mixed, train, Choices(cp=1, tp=1), top=1)
    print(f"the planner's own choice: {free.candidates[0].plan.describe()} ({_work_split(free.candidates[0].plan)})")

    with tempfile.TemporaryDirectory() as folder:
        configs, where = [], []
        for round_index in range(args.rounds):
            for name, pair in scenarios.items():
                for which, plan in zip(("naive", "aware"), pair):
                    path = os.path.join(folder, f"{len(configs)}.jsonl")
                    configs.append(RunConfig(plan.to_toml(), steps=args.steps, device="cpu", show_progress=False,
                                             metrics_file=path))
                    where.append((name, which, path))
        os.environ[ENV] = knob  # the workers inherit it
        launch(configs, args.world)
        measured: dict[tuple[str, str], list[float]] = {}
        for name, which, path in where:
            times = [json.loads(line)["step_time_s"] for line in Path(path).read_text().splitlines()][1:]
            measured.setdefault((name, which), []).append(statistics.median(times))

    header = f"{'scenario':<10} {'plan':<40} {'work split':<22} {'measured':>9} {'predicted':>9}"
    print(header)
    print("-" * len(header))
    for name, (naive, aware) in scenarios.items():
        row = {}
        for which, plan in (("naive", naive), ("aware", aware)):
            row[which] = (statistics.median(measured[(name, which)]), predicted_step(plan))
            print(f"{name if which == 'naive' else '':<10} {which + ': ' + plan.describe():<40} "
                  f"{_work_split(plan):<22} {row[which][0]:>8.3f}s {row[which][1]:>8.3f}s")
        rounds = [n / a for n, a in zip(measured[(name, "naive")], measured[(name, "aware")])]
        print(f"{'':<10} naive / aware: measured {row['naive'][0] / row['aware'][0]:.2f}x (rounds: "
              f"{', '.join(f'{r:.2f}' for r in rounds)}), predicted {row['naive'][1] / row['aware'][1]:.2f}x")


if __name__ == "__main__":
    main()
