"""The `fivefold` command: parsing and printing only; the work lives in the modules.

Verbs: plan, estimate, simulate, train, generate, serve, profile, report, convert. Any bad input ends with one line
`error: FIELD=VALUE: what would be valid` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from fivefold.cliparse import OneLineParser, print_json_error, wants_json
from fivefold.errors import FivefoldError, SpecError
from fivefold.interrupt import Interrupted, sigterm_raises
from fivefold.outputs import check_output_dir, check_output_file, make_dir, make_parents
from fivefold.jobfile import add_job_flags, parse_with_job_file
from fivefold.flags import (add_diloco_flags, add_json_flag, add_layout_flags, add_run_flags,
                            add_spec_flags, add_stack_flag, add_workload_flags, diloco_of_args, layout_from_args,
                            plan_from_args, specs_from_args, stack_of_args)

EXIT_BAD_INPUT = 2
EXIT_NOT_BUILT = 3


class NotBuilt(FivefoldError):
    """A verb that exists in the interface but not yet in the code."""


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def console():
    """Rich console on stdout; when piped (logs, CI, README examples) use a wide page instead of 80 columns."""
    import os

    from rich.console import Console

    wide = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 132
    return Console(stderr=False, highlight=False, width=wide)


# --- verbs -------------------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> int:
    if args.serve:
        from fivefold.serving_cli import cmd_plan_serve

        return cmd_plan_serve(args, console, print_json)
    from fivefold.serving_cli import check_serve_only_flags

    check_serve_only_flags(args)
    from fivefold.planner import Choices, search
    from fivefold.planner.render import plan_json, plan_renderables, plan_title
    from fivefold.planner.rerank import rerank_by_simulation

    model, cluster, train = specs_from_args(args)
    if args.out:  # before the search: a bad path must not cost a search first
        check_output_file(args.out, "--out")
    if args.simulate_top < 0:
        raise SpecError("--simulate-top", args.simulate_top, "must be 0 (off) or a positive count")

    def progress(done: int, total: int, seconds: float) -> None:
        print(f"searching: {done}/{total} degree splits in {seconds:.1f} s", file=sys.stderr, flush=True)

    result = search(model, cluster, train, Choices(**layout_from_args(args)), headroom=args.headroom, top=args.top,
                    stack=stack_of_args(args), progress=progress)
    rerank_by_simulation(result, args.simulate_top)
    dryruns: dict[int, dict] = {}
    if args.dryrun_top > 0:
        from fivefold.dryrun.report import check_top

        top = [c.plan for c in result.candidates[:args.dryrun_top]]
        log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
        dryruns = {id(plan): verdict for plan, verdict in zip(top, check_top(top, log=log))}
    if args.out:  # after every check that can refuse: a refused command writes nothing
        result.candidates[0].plan.save(make_parents(args.out, "--out"))
    if args.json:
        print_json(plan_json(result, model.name, cluster.label, args.out, dryruns))
        return 0
    out = console()
    for renderable in plan_renderables(result, plan_title(model, cluster, train, len(result.candidates))):
        out.print(renderable)
    if args.out:
        out.print(f"wrote the best plan to {args.out}")
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    if args.serve:
        from fivefold.serving_cli import cmd_estimate_serve

        return cmd_estimate_serve(args, console, print_json)
    from fivefold.serving_cli import check_serve_only_flags

    check_serve_only_flags(args)
    from fivefold.cost import estimate

    plan = plan_from_args(args)
    diloco = diloco_of_args(args, plan)  # --dp-sync diloco: checked before anything is costed
    result = estimate(plan, stack_of_args(args))
    if diloco is not None:
        from fivefold.cost.diloco import diloco_cost

        diloco = diloco_cost(plan, diloco, result, stack_of_args(args))
    if args.json:
        print_json({**result.to_dict(), **({"diloco": diloco.to_dict()} if diloco else {})})
        return 0
    from fivefold.planner.render import diloco_lines, estimate_renderables, estimate_title

    out = console()
    for renderable in estimate_renderables(result, estimate_title(plan)) + (diloco_lines(diloco) if diloco else []):
        out.print(renderable)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.serve:
        from fivefold.serving_cli import cmd_simulate_serve

        return cmd_simulate_serve(args, console, print_json)
    from fivefold.serving_cli import check_serve_only_flags

    check_serve_only_flags(args)
    from fivefold.cost import estimate as estimate_plan
    from fivefold.sim import parse_stage_times, simulate_plan
    from fivefold.sim.outputs import write_outputs

    plan = plan_from_args(args)
    diloco = diloco_of_args(args, plan)  # --dp-sync diloco: one outer cycle (sim/diloco.py)
    check_output_dir(args.out_dir, "--out-dir")
    stage_scale = parse_stage_times(args.stage_time, plan.num_stages)
    estimate = estimate_plan(plan, stack_of_args(args))
    if diloco is not None:
        from fivefold.sim.diloco import simulate_diloco_plan

        result, estimate = simulate_diloco_plan(plan, diloco, estimate, stack_of_args(args), stage_scale)
    else:
        result = simulate_plan(plan, stage_scale, estimate=estimate)
    out_dir = make_dir(args.out_dir, "--out-dir")
    trace_path, png_path = write_outputs(result, out_dir)
    if args.json:
        print_json({**result.to_dict(), "estimate_step_time_s": estimate.step_time_s,
                    "trace": str(trace_path), "timeline": str(png_path)})
        return 0
    from fivefold.sim.render import simulate_renderables

    out = console()
    compared = None if stage_scale else estimate.step_time_s  # a what-if has no estimate to compare with
    for renderable in simulate_renderables(result, compared, trace_path, png_path):
        out.print(renderable, soft_wrap=isinstance(renderable, str))
    return 0


def cmd_dryrun(args: argparse.Namespace) -> int:
    from fivefold.dryrun.report import overflow_lines, rank_line, summary_line
    from fivefold.dryrun.run import dry_run

    plan = plan_from_args(args)
    show = None if args.json else (lambda one: print(rank_line(one), flush=True))
    result = dry_run(plan, args.device, on_rank=show)
    if args.json:
        print_json(result.to_dict())
    else:
        print(summary_line(result))
        for note in result.notes:
            print(f"note: {note}")
    for line in overflow_lines(result):
        print(f"error: {line}", file=sys.stderr)
    return 0 if result.fits else 1


def cmd_train(args: argparse.Namespace) -> int:
    from fivefold.training_cli import cmd_train as train_verb

    return train_verb(args, print_json)


def cmd_profile(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise SpecError("--nproc", args.nproc, "must be at least 1 (2 or more also measures collectives)")
    check_output_file(args.out, "--out")  # before measuring, not after
    from fivefold.profile.render import profile_renderables, profile_with_progress
    from fivefold.runtime.launch import check_local_workers

    check_local_workers(args.nproc, "--nproc")

    profile = profile_with_progress(args.nproc, args.quick, show=not args.json)
    profile.save(make_parents(args.out, "--out"))
    if args.json:
        print_json({**profile.to_dict(), "out": args.out})
        return 0
    out = console()
    for renderable in profile_renderables(profile, args.out):
        out.print(renderable)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from fivefold.report import report_run
    from fivefold.report.serving import serving_run_file

    if serving_run_file(args.run) is not None:  # a serving run (generate or serve --metrics-file)
        from fivefold.serving_cli import cmd_report_serve

        return cmd_report_serve(args, console, print_json)
    from fivefold.report.curves import report_training
    from fivefold.report.training import compare_lines, training_lines

    report = report_run(args.run, args.stack)
    training, compared = report_training(args.run, args.compare)
    if args.json:
        print_json({**report.to_dict(), "training": training.to_dict(),
                    "compared": [summary.to_dict() for summary in compared]})
        return 0
    from fivefold.report.render import report_renderables

    out = console()
    for renderable in report_renderables(report):
        out.print(renderable, soft_wrap=isinstance(renderable, str))
    for line in training_lines(training):
        out.print(line, soft_wrap=True)
    if compared:
        out.print(compare_lines([training, *compared]))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    if bool(args.from_hf) == bool(args.to_hf):
        raise SpecError("--from-hf/--to-hf", args.from_hf or args.to_hf, "give exactly one of the two")
    if not args.out:
        raise SpecError("--out", None, "required: the checkpoint (with --from-hf) or folder (with --to-hf) to write")
    from fivefold.checkpoint.hf import convert_from_hf, convert_to_hf
    from fivefold.checkpoint.layout import read_checkpoint_info

    check_output_dir(args.out, "--out")

    if args.from_hf:
        out = convert_from_hf(args.from_hf, args.out)
        spec, kind = read_checkpoint_info(out)["model"], "fivefold checkpoint"
    else:
        out = convert_to_hf(args.to_hf, args.out)
        from fivefold.checkpoint.hf import read_hf_config

        spec, kind = read_hf_config(out)[1], "Hugging Face folder"
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    if args.json:
        print_json({"out": str(out), "kind": kind, "model": spec.to_dict(), "params": spec.num_params(),
                    "files": files})
    else:
        console().print(f"wrote {kind} [bold]{out}[/]: {spec.layers} layers, hidden {spec.hidden}, "
                        f"vocab {spec.vocab}, {spec.num_params():,} parameters", soft_wrap=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fivefold",
        description="Plan, predict and run hybrid-parallel transformer training (dp x tp x pp x cp x ep).")
    from fivefold import __version__

    parser.add_argument("--version", action="version", version=f"fivefold {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, help_text: str, handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        return sub

    p = verb("plan", "search every dp x tp x pp x cp split and rank the layouts by predicted speed", cmd_plan)
    add_spec_flags(p)
    add_layout_flags(p, for_search=True)
    add_workload_flags(p, for_search=True)
    p.add_argument("--top", type=int, default=5, help="how many plans to show (default: 5)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of device memory kept free (default: 0.1)")
    p.add_argument("--out", default=None, help="write the best plan to this TOML file")
    p.add_argument("--simulate-top", type=int, default=0, help="re-rank the best N by simulation")
    p.add_argument("--dryrun-top", type=int, default=0, help="dry-run the best N plans (fivefold dryrun)")
    add_stack_flag(p)
    add_json_flag(p)

    p = verb("estimate", "predict step time, throughput, memory and bubble of one plan", cmd_estimate)
    add_spec_flags(p)
    add_layout_flags(p)
    add_workload_flags(p)
    add_stack_flag(p)
    add_json_flag(p)
    add_diloco_flags(p)

    p = verb("simulate", "replay one step of a plan rank by rank; write a trace and a timeline picture",
             cmd_simulate)
    add_spec_flags(p)
    add_layout_flags(p)
    add_workload_flags(p)
    p.add_argument("--out-dir", default="out/simulate", help="where to write trace.json and timeline.png")
    p.add_argument("--stage-time", action="append", default=[], metavar="STAGE=SCALE",
                   help="what-if: scale the compute time of one stage (repeatable), e.g. 0=1.5")
    add_stack_flag(p)
    add_json_flag(p)
    add_diloco_flags(p)

    p = verb("dryrun", "build each kind of rank of a plan with the real runtime on fake tensors and measure its "
             "peak memory against the estimate (no GPU needed)", cmd_dryrun)
    add_spec_flags(p)
    add_layout_flags(p)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="runtime configuration to build: cuda (bf16 mixed precision) or cpu (default: cuda for GPU "
                        "clusters, cpu for CPU clusters)")
    add_json_flag(p)

    p = verb("train", "run a plan with torch.distributed (gloo on CPU, NCCL on GPU)", cmd_train)
    p.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)  # set by the torchrun line
    add_job_flags(p)  # --config, --dump-config, --slurm
    add_spec_flags(p)
    add_layout_flags(p)
    add_run_flags(p)
    add_json_flag(p)

    from fivefold.serve.verbs import add_serve_verbs

    add_serve_verbs(verb, add_json_flag, print_json)

    p = verb("profile", "measure this machine: GEMMs, memory bandwidth, collectives", cmd_profile)
    p.add_argument("--quick", action="store_true", help="a small grid, under a minute")
    p.add_argument("--nproc", type=int, default=2, help="processes for the collective measurements")
    p.add_argument("--out", default="profile.toml", help="profile file (accepted by --cluster)")
    add_json_flag(p)

    p = verb("report", "compare what a run's plan predicted with what the run measured; a training run's curves, "
             "launches and restarts", cmd_report)
    p.add_argument("run", help="run folder (with plan.toml and metrics.jsonl) or a metrics file")
    p.add_argument("--compare", nargs="+", default=None, metavar="RUN2",
                   help="training runs to overlay on RUN's curves (RUN/report-compare.png) and compare in a table")
    p.add_argument("--stack", default=None, help="software the cost model assumes (default: fivefold, the "
                   "runtime's own, when the cost model has it, else modern)")
    add_json_flag(p)

    p = verb("convert", "convert checkpoints to and from Hugging Face format", cmd_convert)
    p.add_argument("--from-hf", default=None, help="a local Hugging Face Llama, Mixtral or Qwen3-MoE folder to import")
    p.add_argument("--to-hf", default=None, help="a fivefold checkpoint to export")
    p.add_argument("--out", required=False, default=None, help="output checkpoint or folder")
    add_json_flag(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    json_errors = wants_json(argv)  # known even when the command line itself cannot be parsed
    with sigterm_raises():
        try:
            args = parse_with_job_file(build_parser(), argv)
            return int(args.handler(args) or 0)
        except NotBuilt as exc:
            print(f"not built: {exc}", file=sys.stderr)
            return EXIT_NOT_BUILT
        except FivefoldError as exc:
            print(f"error: {exc}", file=sys.stderr)
            if json_errors:
                print_json_error(exc, EXIT_BAD_INPUT)
            return EXIT_BAD_INPUT
        except Interrupted as exc:  # SIGTERM, or a signal that stopped the workers of `train`
            if exc.line:  # a torchrun worker other than rank 0 leaves the line to rank 0
                print(exc.line, file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
