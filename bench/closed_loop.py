"""The closed loop on this machine: profile it, plan, train, and compare predicted with measured step time.

    .venv/bin/python bench/closed_loop.py [--models tiny,small,small-moe] [--procs 1,2,4] [--steps 8] [--threads 1]
                                          [--repeats 1] [--quick-profile] [--quiet-load 1.5]
                                          [--write docs/validation.md]

For every process count N (1, 2, 4), one after another:
1. `fivefold profile` (`--quick` with --quick-profile) with N ranks: GEMMs, memory bandwidth and the eager
   runtime's host costs measured by all N ranks at once, collectives over N gloo ranks (and over pairs of
   ranks side by side when N >= 4) (profile-N.toml);
2. for every model (tiny, small and small-moe, an MoE version of small with 8 experts, top-2), a fixed
   representative set of plans, each the planner's best of its kind (fivefold stack, that profile): for
   N = 1 the micro-batch sizes; for N > 1 every dp x tp x pp x cp x ep split the runtime can run, and for
   pure data parallelism of a dense model ZeRO 0, 1 and 3 as well;
3. each plan trains a few steps (one launch per model and N, the plans one after another in the same
   processes); the measured step time is the report's (fivefold.report: median after the warm-up steps),
   the prediction the cost model's for the plan's calibrated cluster (the report's own figure; for an ep > 1
   run it takes the expert imbalance the run measured, as `fivefold report` does).
Then a table per model and N: predicted, measured, error, and the planner's order against the measured
one (Spearman's rho, same order or not, and how much slower the predicted-fastest plan ran than the
measured-fastest).

Profiling right before training keeps both in the same state of a shared machine; --quiet-load first waits
for a low load average. Threads: one per rank by default (OMP_NUM_THREADS=1, for the profile and the runs
alike). The launcher's default, cores // N, gives a single rank 2 OpenMP threads on a 2-core machine, and
those collapse (spin-waiting barriers) whenever anything else wants a core: a step of the tiny model then
takes 40 ms or 600 ms depending on the neighbours, which no profile can predict.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from fivefold.cost.stack import STACKS  # noqa: E402
from fivefold.errors import FivefoldError  # noqa: E402
from fivefold.planner import Choices, search  # noqa: E402
from fivefold.planner.space import degree_options  # noqa: E402
from fivefold.report import build_report, load_run  # noqa: E402
from fivefold.spec import Plan, TrainSpec, load_plan, parse_cluster, parse_model  # noqa: E402
from overhead import MOE  # noqa: E402  (bench/overhead.py's ep2 model)

STACK = "fivefold"
HEADING = "## Closed loop on this machine (bench/closed_loop.py)"
NEAR_TIE = 0.05  # the predicted-fastest plan "wins" when it is within this of the measured fastest
# Models by name beyond the presets: the MoE version of `small` of bench/overhead.py's ep2 row.
MODELS = {"small-moe": MOE}


@dataclass
class Result:
    """One plan of the loop: what the cost model predicted and what the run measured."""

    model: str
    procs: int
    plan: Plan
    predicted_s: float
    measured_s: float | None = None  # the median over the repeats
    repeats: list[float] | None = None  # each repeat's measured step time (one launch each)
    breakdown: list[dict] | None = None  # the report's compute / optimizer / other, when traced

    @property
    def error(self) -> float | None:
        return None if not self.measured_s else self.predicted_s / self.measured_s - 1


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "n/a"


def wait_for_quiet(threshold: float, patience_s: float) -> None:
    """Wait (up to `patience_s`) until the 1-minute load average is below `threshold`."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        load = float(load_average().split()[0]) if load_average() != "n/a" else 0.0
        if load < threshold:
            return
        print(f"load average {load:.2f} >= {threshold}: waiting", flush=True)
        time.sleep(30)


def machine_description() -> str:
    model = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import torch

    return f"{os.cpu_count()} cores, {model}, torch {torch.__version__}, Python {platform.python_version()}"


def profile_files(procs: list[int], folder: Path, reuse: bool, quick: bool) -> dict[int, Path]:
    """profile-N.toml for each process count, measured now unless `reuse` finds them."""
    from fivefold.profile.run import run_profile

    files = {}
    for n in procs:
        path = folder / f"profile-{n}.toml"
        if not (reuse and path.exists()):
            started = time.perf_counter()
            run_profile(n, quick=quick).save(path)
            print(f"profiled {n} process(es) in {time.perf_counter() - started:.0f} s -> {path}", flush=True)
        files[n] = path
    return files


def _runnable(plan: Plan) -> bool:
    from fivefold.runtime.launch import check_runnable

    try:
        check_runnable(plan, plan.world_size)
        return True
    except FivefoldError:
        return False


def _best(model, cluster, train, choices: Choices, top: int = 12) -> Plan | None:
    """The planner's fastest plan under `choices` that the runtime can run."""
    try:
        found = search(model, cluster, train, choices, top=top, stack=STACKS[STACK])
    except FivefoldError:
        return None
    return next((c.plan for c in found.candidates if _runnable(c.plan)), None)


def representative_plans(model_name: str, cluster_file: Path, train: TrainSpec) -> list[Plan]:
    """Each plan the planner's best of its kind (module docstring), ordered by predicted step time."""
    model, cluster = parse_model(MODELS.get(model_name, model_name)), parse_cluster(str(cluster_file))
    plans: list[Plan] = []
    if cluster.world_size == 1:
        for micro_batch in sorted({1, 2, 4, train.global_batch} & set(range(1, train.global_batch + 1))):
            if train.global_batch % micro_batch == 0:
                plans.append(_best(model, cluster, train, Choices(micro_batch=micro_batch)))
    else:
        for dp, tp, pp, cp, ep in degree_options(model, cluster, train, Choices()):
            zeros = (0, 1, 3) if dp > 1 and tp == pp == cp == 1 and not model.is_moe else (None,)
            for zero in zeros:
                plans.append(_best(model, cluster, train, Choices(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero)))
    unique = {p.describe(): p for p in plans if p is not None}
    from fivefold.cost import estimate

    return sorted(unique.values(), key=lambda p: estimate(p, STACKS[STACK]).step_time_s)


def train_plans(plans: list[Plan], folder: Path, steps: int, trace: bool) -> list[Path]:
    """Train every plan `steps` steps in one launch; one run folder (plan.toml, metrics.jsonl) each."""
    from fivefold.runtime import RunConfig, launch

    runs, configs = [], []
    for index, plan in enumerate(plans):
        run = folder / f"{index:02d}-{plan.describe().replace(' ', '_').replace('(', '').replace(')', '')}"
        run.mkdir(parents=True, exist_ok=True)
        (run / "metrics.jsonl").unlink(missing_ok=True)
        (run / "trace.jsonl").unlink(missing_ok=True)
        plan.save(run / "plan.toml")
        runs.append(run)
        configs.append(RunConfig(plan_toml=plan.to_toml(), steps=steps, device="cpu", show_progress=False,
                                 metrics_file=str(run / "metrics.jsonl"), trace=trace))
    launch(configs, plans[0].world_size)
    return runs


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (no ties expected in timings); None below 3 items."""
    if len(xs) < 3:
        return None

    def ranks(values: list[float]) -> list[int]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0] * len(values)
        for rank, index in enumerate(order):
            out[index] = rank
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def ranking(results: list[Result]) -> dict:
    """The planner's order against the measured one, for one model and process count."""
    done = [r for r in results if r.measured_s]
    predicted = [r.predicted_s for r in done]
    measured = [r.measured_s for r in done]
    if not done:
        return {"plans": 0}
    picked = min(done, key=lambda r: r.predicted_s)
    fastest = min(measured)
    same_order = sorted(range(len(done)), key=predicted.__getitem__) == sorted(range(len(done)),
                                                                              key=measured.__getitem__)
    return {"plans": len(done), "rho": spearman(predicted, measured), "same_order": same_order,
            "pick_regret": picked.measured_s / fastest - 1, "pick": picked.plan.describe()}


def run_loop(args: argparse.Namespace) -> tuple[list[Result], dict[int, str]]:
    """Per process count: profile, then train every model's plans right away, so the profile and the
    runs see the machine in the same state (other users come and go on a shared machine)."""
    from fivefold.cost import estimate

    folder = Path(args.out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    train = TrainSpec(seq_len=args.seq_len, global_batch=args.global_batch, dtype="fp32")
    results: list[Result] = []
    loads: dict[int, str] = {}
    recorded = _recorded(args)
    for n in [int(n) for n in args.procs.split(",")]:
        if args.quiet_load:
            wait_for_quiet(args.quiet_load, args.patience)
        loads[n] = recorded.get(str(n), load_average())
        profile = profile_files([n], folder, reuse=args.reuse_profiles or args.reuse_runs,
                                quick=args.quick_profile)[n]
        for model_name in args.models.split(","):
            if args.reuse_runs:  # the plans as trained (their plan.toml), not the planner's picks today
                first = folder / f"{model_name}-{n}{'-r0' if args.repeats > 1 else ''}"
                plans = [load_plan(run / "plan.toml") for run in sorted(first.iterdir()) if run.is_dir()]
            else:
                plans = representative_plans(model_name, profile, train)
            group = [Result(model_name, n, p, estimate(p, STACKS[STACK]).step_time_s) for p in plans]
            started = time.perf_counter()
            for repeat in range(args.repeats):
                suffix = f"-r{repeat}" if args.repeats > 1 else ""
                runs = (sorted(p for p in (folder / f"{model_name}-{n}{suffix}").iterdir() if p.is_dir())
                        if args.reuse_runs else
                        train_plans(plans, folder / f"{model_name}-{n}{suffix}", args.steps, args.trace))
                for result, run in zip(group, runs):
                    report = build_report(load_run(run), STACK)[0]
                    step = report.figures[0]
                    result.predicted_s = step.predicted
                    result.repeats = (result.repeats or []) + ([step.measured] if step.measured else [])
                    result.breakdown = report.breakdown if args.trace else None
            for result in group:
                result.measured_s = statistics.median(result.repeats) if result.repeats else None
            print(f"{model_name} on {n} process(es): {len(plans)} plans trained in "
                  f"{time.perf_counter() - started:.0f} s (load average before: {loads[n]})", flush=True)
            print_group(group)
            results.extend(group)
    return results, loads


def _recorded(args: argparse.Namespace) -> dict:
    """The load averages (before each process count, after) and minutes the runs in --out-dir recorded."""
    record = Path(args.out_dir) / "loads.json"
    return json.loads(record.read_text()) if args.reuse_runs and record.is_file() else {}


def print_group(group: list[Result]) -> None:
    print(f"  {'plan':46} {'predicted':>10} {'measured':>10} {'error':>7}   compute/optimizer/other (pred | meas)")
    for r in group:
        parts = ""
        if r.breakdown:
            parts = (" / ".join(f"{b['predicted_s'] * 1e3:.1f}" for b in r.breakdown) + " | "
                     + " / ".join(f"{(b['measured_s'] or 0) * 1e3:.1f}" for b in r.breakdown))
        print(f"  {r.plan.describe():46} {r.predicted_s * 1e3:8.1f}ms {(r.measured_s or 0) * 1e3:8.1f}ms "
              f"{100 * (r.error or 0):+6.1f}%   {parts}")
    rank = ranking(group)
    if rank["plans"]:
        rho = "n/a" if rank["rho"] is None else f"{rank['rho']:+.2f}"
        print(f"  ranking: Spearman {rho}, same order: {'yes' if rank['same_order'] else 'no'}, predicted-fastest "
              f"plan {rank['pick']} is {100 * rank['pick_regret']:.1f}% slower than the measured fastest", flush=True)


def markdown(results: list[Result], args: argparse.Namespace, machine: str, loads: dict, minutes: float) -> str:
    errors = [abs(r.error) for r in results if r.error is not None]
    within = sum(e <= 0.15 for e in errors)
    spread = args.repeats > 1
    lines = [HEADING, "",
             f"Produced by `.venv/bin/python bench/closed_loop.py{f' --repeats {args.repeats}' if spread else ''} "
             f"--write docs/validation.md` "
             f"(models {args.models}, {args.procs} processes, seq {args.seq_len}, global batch "
             f"{args.global_batch}, fp32, {args.steps} steps per plan, the first 2 left out as warm-up, as "
             f"`fivefold report` does; {args.threads or 'cores // N'} thread(s) per rank"
             + (f"; {args.repeats} launches per model and process count, measured = their median" if spread else "")
             + f"). Machine: {machine}. Load average (1/5/15 min) before each process "
             f"count: " + "; ".join(f"{n}: {load}" for n, load in loads.items() if n != "after")
             + f"; after: {loads['after']}. The whole loop took {minutes:.1f} min.", "",
             f"For each process count N, `fivefold profile{' --quick' if args.quick_profile else ''}` measured "
             "the machine with N processes "
             "working at once; each plan is the planner's best of its kind (fivefold stack, that profile), "
             "predicted with the cost model and trained by `fivefold train`'s launcher.", "",
             f"Step time within 15%: {within} of {len(errors)} plans; mean absolute error "
             f"{100 * statistics.mean(errors):.1f}%, worst {100 * max(errors):.1f}%." if errors else "", ""]
    for n in sorted({r.procs for r in results}):
        share = [abs(r.error) for r in results if r.procs == n and r.error is not None]
        if share:
            lines.append(f"- {n} process{'es' if n > 1 else ''}"
                         f"{' (more processes than cores)' if n > (os.cpu_count() or n) else ''}: "
                         f"{sum(e <= 0.15 for e in share)} of {len(share)} within 15%, mean absolute error "
                         f"{100 * statistics.mean(share):.1f}%, worst {100 * max(share):.1f}%")
    lines.append("")
    for model_name in args.models.split(","):
        for n in sorted({r.procs for r in results}):
            group = [r for r in results if r.model == model_name and r.procs == n]
            if not group:
                continue
            rank = ranking(group)
            rho = "n/a (fewer than 3 plans)" if rank.get("rho") is None else f"{rank['rho']:+.2f}"
            lines += [f"### {model_name}, {n} process{'es' if n > 1 else ''}", "",
                      "| planner rank | plan | predicted | measured | error | measured rank |"
                      + (" measured range |" if spread else ""),
                      "|---|---|---|---|---|---|" + ("---|" if spread else "")]
            measured_order = sorted(group, key=lambda r: r.measured_s or float("inf"))
            for index, r in enumerate(sorted(group, key=lambda r: r.predicted_s), 1):
                lines.append(f"| {index} | {r.plan.describe()} | {r.predicted_s * 1e3:.1f} ms | "
                             f"{(r.measured_s or 0) * 1e3:.1f} ms | {100 * (r.error or 0):+.1f}% | "
                             f"{measured_order.index(r) + 1} |" + (_range(r) if spread else ""))
            if rank["plans"]:
                lines += ["", f"Ranking: Spearman {rho}; same order: {'yes' if rank['same_order'] else 'no'}; "
                              f"the predicted-fastest plan is {100 * rank['pick_regret']:.1f}% slower than the "
                              f"measured fastest.", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _range(result: Result) -> str:
    """ min-max of the repeats and their spread relative to the median, as a table cell."""
    if not result.repeats or not result.measured_s:
        return " n/a |"
    low, high = min(result.repeats), max(result.repeats)
    return f" {low * 1e3:.1f}-{high * 1e3:.1f} ms ({100 * (high - low) / result.measured_s:.0f}%) |"


def write_section(path: Path, section: str) -> None:
    """Replace (or add) this section of docs/validation.md; other sections are left as they are."""
    text = path.read_text() if path.is_file() else "# Validation\n\n"
    if HEADING in text:
        before, _, rest = text.partition(HEADING)
        following = rest.find("\n## ")
        after = rest[following + 1:] if following >= 0 else ""
        text = before + section + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small,small-moe")
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="steps per plan (the first 2 are warm-up)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="launches per model and process count (after one profile); the measured step is "
                             "their median, and the table shows their range")
    parser.add_argument("--out-dir", default="out/closed_loop", help="profiles and run folders")
    parser.add_argument("--reuse-profiles", action="store_true", help="keep profile-N.toml files already there")
    parser.add_argument("--quick-profile", action="store_true",
                        help="`fivefold profile --quick` (seconds instead of 1-3 minutes per process count; its "
                             "2-rank GEMM rates vary by up to 30%% between runs, the full profile's by 2%%)")
    parser.add_argument("--reuse-runs", action="store_true",
                        help="train nothing: predict the plans of the run folders already there with today's cost "
                             "model against what those runs measured (their profiles too)")
    parser.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                        help="trace the runs, to print compute / optimizer / other (default: on)")
    parser.add_argument("--write", type=Path, default=None, help="write the Markdown section to this file")
    parser.add_argument("--quiet-load", type=float, default=0.0,
                        help="first wait (up to --patience seconds) for the 1-minute load average to drop below this")
    parser.add_argument("--patience", type=float, default=1800.0)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per rank, for the profile and the runs alike (OMP_NUM_THREADS); "
                             "0: the launcher's cores // N (default 1: see the module docstring)")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    started = time.perf_counter()
    results, loads = run_loop(args)
    minutes = (time.perf_counter() - started) / 60
    loads["after"] = load_average()
    if args.reuse_runs:  # what the runs saw and took, not this re-prediction
        loads["after"], minutes = _recorded(args).get("after", "n/a"), _recorded(args).get("minutes", 0.0)
    else:
        (Path(args.out_dir) / "loads.json").write_text(json.dumps({**{str(n): v for n, v in loads.items()},
                                                                   "minutes": minutes}))
    print(f"load average after: {loads['after']}; {minutes:.1f} min")
    section = markdown(results, args, machine_description(), loads, minutes)
    print(section)
    if args.write:
        write_section(args.write, section)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
