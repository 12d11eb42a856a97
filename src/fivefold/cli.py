"""The `fivefold` command: parsing and printing only; the work lives in the modules.

Verbs: plan, estimate, simulate, train, profile, report, convert. Any bad input ends with one line
`error: FIELD=VALUE: what would be valid` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from fivefold.errors import FivefoldError, SpecError

EXIT_BAD_INPUT = 2
EXIT_NOT_BUILT = 3


class NotBuilt(FivefoldError):
    """A verb that exists in the interface but not yet in the code."""


# --- shared flags ------------------------------------------------------------------------------

def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """--model/--cluster/--seq-len/--global-batch/--dtype: what to train and where."""
    group = parser.add_argument_group("what and where")
    group.add_argument("--model", default="tiny", help="preset name, TOML file, or inline "
                       "layers=..,hidden=..,heads=..,vocab=..[,mlp=gelu] (default: tiny)")
    group.add_argument("--cluster", default="1x4xcpu",
                       help="NODESxGPUSxDEVICE[:nvlink=..,nic=..] groups joined by '+', or a TOML file "
                            "(default: 1x4xcpu)")
    group.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    group.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step (default: 8)")
    group.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "fp8"], default=None,
                       help="compute dtype (default: fp32 on cpu clusters, bf16 otherwise); fp8: FP8 GEMMs, "
                            "BF16 elsewhere (H100 and newer)")


def add_layout_flags(parser: argparse.ArgumentParser, for_search: bool = False) -> None:
    """Degrees and the rest of a layout. In `plan` each fixes that choice of the search."""
    group = parser.add_argument_group("layout" + (" (each one given fixes that choice in the search)"
                                                  if for_search else ""))
    for dim, text in (("dp", "data-parallel"), ("tp", "tensor-parallel"), ("pp", "pipeline-parallel"),
                      ("cp", "context-parallel"), ("ep", "expert-parallel")):
        default_text = "" if for_search else (" (default: world / (tp*pp*cp))" if dim == "dp" else " (default: 1)")
        group.add_argument(f"--{dim}", type=int, default=None, help=f"{text} degree{default_text}")
    group.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default: 1)")
    group.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"], default=None,
                       help="pipeline schedule (default: 1f1b)")
    group.add_argument("--virtual-stages", type=int, default=None,
                       help="model chunks per pipeline rank (default: 1; 2 for zbv)")
    group.add_argument("--layers-per-stage", default=None, help="comma-separated layers of each stage, e.g. 3,5")
    group.add_argument("--recompute", choices=["none", "selective", "full"], default=None,
                       help="activation recompute (default: none)")
    group.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                       help="sequence parallel with tp (default: on when tp > 1)")
    group.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                       help="ZeRO level; 3 = FSDP (default: 0)")
    if not for_search:
        group.add_argument("--plan", default=None, help="a plan TOML file (replaces all the flags above)")


def add_stack_flag(parser: argparse.ArgumentParser) -> None:
    from fivefold.cost.stack import stack_help

    parser.add_argument("--stack", default="modern", help="software the cost model assumes, and what it can run "
                        "(default: modern). " + stack_help())


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")


def specs_from_args(args: argparse.Namespace):
    """(ModelSpec, ClusterSpec, TrainSpec) from the shared flags."""
    from fivefold.spec import TrainSpec, parse_cluster, parse_model

    model = parse_model(args.model)
    cluster = parse_cluster(args.cluster)
    dtype = args.dtype or ("fp32" if all(g.device.name == "cpu" for g in cluster.groups) else "bf16")
    train = TrainSpec(seq_len=args.seq_len, global_batch=args.global_batch, dtype=dtype)
    return model, cluster, train


def plan_from_args(args: argparse.Namespace):
    """A Plan from --plan FILE, or from the spec and layout flags."""
    from fivefold.spec import Plan, load_plan

    if getattr(args, "plan", None):
        return load_plan(args.plan)
    model, cluster, train = specs_from_args(args)
    tp, pp, cp, ep = (getattr(args, d) or 1 for d in ("tp", "pp", "cp", "ep"))
    if args.dp is None:
        inner = tp * pp * cp
        if cluster.world_size % inner:
            raise SpecError("--tp*--pp*--cp", inner, f"must divide the cluster's {cluster.world_size} devices")
        dp = cluster.world_size // inner
    else:
        dp = args.dp
    schedule = args.schedule or "1f1b"
    virtual = args.virtual_stages or (2 if schedule == "zbv" else 1)
    layers = ()
    if args.layers_per_stage:
        try:
            layers = tuple(int(x) for x in args.layers_per_stage.split(","))
        except ValueError:
            raise SpecError("--layers-per-stage", args.layers_per_stage, "write integers separated by commas") from None
    sequence_parallel = args.sequence_parallel if args.sequence_parallel is not None else tp > 1
    return Plan(model=model, cluster=cluster, train=train, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep,
                zero=args.zero or 0, micro_batch=args.micro_batch or 1, schedule=schedule,
                virtual_stages=virtual, layers_per_stage=layers, recompute=args.recompute or "none",
                sequence_parallel=sequence_parallel)


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
    from fivefold.cost import stack_named
    from fivefold.planner import Choices, search

    model, cluster, train = specs_from_args(args)
    layers = None
    if args.layers_per_stage:
        try:
            layers = tuple(int(x) for x in args.layers_per_stage.split(","))
        except ValueError:
            raise SpecError("--layers-per-stage", args.layers_per_stage, "write integers separated by commas") from None
    choices = Choices(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, micro_batch=args.micro_batch,
                      schedule=args.schedule, virtual_stages=args.virtual_stages, recompute=args.recompute,
                      sequence_parallel=args.sequence_parallel, zero=args.zero, layers_per_stage=layers)

    def progress(done: int, total: int, seconds: float) -> None:
        print(f"searching: {done}/{total} degree splits in {seconds:.1f} s", file=sys.stderr, flush=True)

    result = search(model, cluster, train, choices, headroom=args.headroom, top=args.top,
                    stack=stack_named(args.stack), progress=progress)
    simulated: dict[int, float] = {}
    if args.simulate_top > 0:
        import fivefold.sim

        rerank = getattr(fivefold.sim, "rerank", None)
        if rerank is None:
            print("note: --simulate-top: simulation re-ranking is not available yet; ranking by the cost model",
                  file=sys.stderr)
        else:
            # rerank(plans, n) -> [(plan, simulation)] for the first n, fastest simulated first.
            by_plan = {id(c.plan): c for c in result.candidates}
            reranked = rerank([c.plan for c in result.candidates], args.simulate_top)
            simulated = {id(plan): sim.step_time_s for plan, sim in reranked}
            result.candidates = [by_plan[id(plan)] for plan, _ in reranked] + [
                c for c in result.candidates if id(c.plan) not in simulated]
            if len(result.candidates) > 1:
                from fivefold.planner.explain import explain_difference

                result.explanation = explain_difference(result.candidates[0], result.candidates[1])
    if args.out:
        result.candidates[0].plan.save(args.out)
    if args.json:
        ranked = []
        for rank, candidate in enumerate(result.candidates, 1):
            entry = {k: v for k, v in candidate.estimate.to_dict().items() if k != "stages"}
            if id(candidate.plan) in simulated:
                entry["simulated_step_time_s"] = simulated[id(candidate.plan)]
            ranked.append({"rank": rank, **entry, "layout": candidate.plan.to_dict()["plan"]})
        print_json({"model": model.name, "cluster": cluster.label, "candidates": ranked,
                    "explanation": result.explanation, "placement": result.placement,
                    "examined": result.examined, "costed": result.costed,
                    "seconds": result.seconds, "candidates_per_s": result.candidates_per_s, "out": args.out})
        return 0
    from fivefold.planner.render import plan_renderables

    out = console()
    title = (f"{model.name} on {cluster.label} ({cluster.world_size} GPUs), seq {train.seq_len}, "
             f"global batch {train.global_batch}, {train.dtype}: best {len(result.candidates)} plans that fit")
    for renderable in plan_renderables(result, title):
        out.print(renderable)
    if simulated:
        times = [f"#{i} {simulated[id(c.plan)]:.3f} s" for i, c in enumerate(result.candidates, 1)
                 if id(c.plan) in simulated]
        out.print(f"re-ranked the best {len(simulated)} by simulated step time: " + ", ".join(times))
    out.print(f"why #1: {result.explanation}")
    for line in result.placement:  # mixed clusters: which group holds what, and why
        out.print(f"#1 {line}")
    out.print(f"searched {result.examined:,} candidate plans ({result.costed:,} costed in full) in "
              f"{result.seconds:.2f} s: {result.candidates_per_s:,.0f} candidates/s")
    if args.out:
        out.print(f"wrote the best plan to {args.out}")
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from fivefold.cost import estimate, stack_named

    plan = plan_from_args(args)
    result = estimate(plan, stack_named(args.stack))
    if args.json:
        print_json(result.to_dict())
        return 0
    from fivefold.planner.render import estimate_renderables

    out = console()
    title = (f"{plan.model.name} on {plan.cluster.label}, seq {plan.train.seq_len}, global batch "
             f"{plan.train.global_batch}, {plan.train.dtype}: {plan.describe()}")
    for renderable in estimate_renderables(result, title):
        out.print(renderable)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fivefold.cost import estimate as estimate_plan
    from fivefold.sim import parse_stage_times, simulate_plan, write_chrome_trace, write_timeline_png

    plan = plan_from_args(args)
    stage_scale = parse_stage_times(args.stage_time, plan.num_stages)
    estimate = estimate_plan(plan)
    result = simulate_plan(plan, stage_scale, estimate=estimate)
    out_dir = Path(args.out_dir)
    trace_path = write_chrome_trace(result, out_dir / "trace.json")
    png_path = write_timeline_png(result, out_dir / "timeline.png")
    if args.json:
        print_json({**result.to_dict(), "estimate_step_time_s": estimate.step_time_s,
                    "trace": str(trace_path), "timeline": str(png_path)})
        return 0
    from rich.table import Table

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.4g} ms"

    out = console()
    out.print(f"[bold]{result.title}[/bold]", soft_wrap=True)
    compared = "" if stage_scale else f" (estimate: {ms(estimate.step_time_s)})"
    out.print(f"step {ms(result.step_time_s)}{compared}, pipeline {ms(result.pipeline_time_s)}", soft_wrap=True)
    out.print(f"{result.schedule}, {result.micro_batches} micro-batches, pipeline bubble "
              f"{result.bubble_fraction:.1%} of the busiest rank's work", soft_wrap=True)
    table = Table(box=None, pad_edge=False)
    for column in ("rank", "busy", "comm (exposed)", "idle", "bubble", "peak memory"):
        table.add_column(column, justify="left" if column == "rank" else "right")
    for rank in result.ranks:
        table.add_row(rank.label.replace("\n", " "), f"{rank.busy_s / result.step_time_s:.0%}",
                      f"{rank.exposed_comm_s / result.step_time_s:.0%}", f"{rank.idle_s / result.step_time_s:.0%}",
                      f"{rank.bubble_fraction:.1%}", f"{rank.peak_memory_bytes / 2**30:.3g} GiB")
    out.print(table)
    out.print(f"wrote {trace_path} (open in https://ui.perfetto.dev)", soft_wrap=True)
    out.print(f"wrote {png_path}", soft_wrap=True)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses

    from fivefold.checkpoint.resume import plan_for_hf, resume_checkpoint
    from fivefold.runtime import RunConfig, check_runnable, launch, torchrun_command
    from fivefold.runtime.launch import (WorkerFailed, check_data, check_launch_flags, nodes_of, prepare_run_dir,
                                         resolve_device, run_torchrun_worker, torchrun_world)

    # Everything that can be wrong with the plan, the flags or the data fails here, before any process starts.
    config = RunConfig.from_flags(vars(args), progress_to_stderr=args.json)
    plan = plan_from_args(args)
    config.validate()
    check_launch_flags(args.max_restarts)
    if args.init_from_hf:  # the folder's config.json decides the model
        plan = plan_for_hf(plan, args.init_from_hf, bool(args.plan), bool(args.layers_per_stage))
    device, gpus = resolve_device(args.device)
    # Under torchrun (several machines) this process is one worker: torchrun started the world.
    worker_world = torchrun_world() if args.torchrun_worker else None
    local_nproc = worker_world[1] if worker_world else None
    is_rank0 = worker_world is None or worker_world[2] == 0
    nproc = worker_world[0] if worker_world else args.nproc if args.nproc is not None else plan.world_size
    if args.resume and nproc != plan.world_size:  # shrinking or growing: a plan for the new world size
        from fivefold.elastic.replan import replan_for_world
        from fivefold.planner import Choices

        fixed = Choices() if args.plan else Choices(
            dp=args.dp, tp=args.tp, pp=args.pp, micro_batch=args.micro_batch, schedule=args.schedule,
            virtual_stages=args.virtual_stages, recompute=args.recompute, zero=args.zero)
        plan, line = replan_for_world(plan, nproc, fixed, lambda p: check_runnable(p, nproc, device, gpus, local_nproc))
        if is_rank0:
            print(line, file=sys.stderr if args.json else sys.stdout, flush=True)
    check_runnable(plan, nproc, device, gpus, local_nproc)
    check_data(plan, args.data, args.tokenizer)
    resume_from = resume_checkpoint(plan, args.checkpoint_dir, args.resume, args.seed, args.steps,
                                    warn=lambda line: print(f"warning: {line}", file=sys.stderr))
    run_dir, plan_file = prepare_run_dir(plan, config, args.plan, is_rank0)
    worker_line = config.to_flags()
    config = dataclasses.replace(config, plan_toml=plan.to_toml(), device=device, run_dir=run_dir,
                                 resume_from=str(resume_from) if resume_from else None)
    if worker_world:
        summary = run_torchrun_worker(config)
        if summary and args.json:
            print_json(summary)
        return 0
    info = sys.stderr if args.json else sys.stdout
    nodes, per_node = nodes_of(plan)
    command = torchrun_command(plan_file or "PLAN.toml", worker_line, nodes, per_node)
    print(f"on several machines, run on each: {command}", file=info, flush=True)
    try:
        summary = launch([config], nproc, max_restarts=args.max_restarts)[0]
    except WorkerFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_json(summary)
        return 0
    if "recovery" in summary:
        from fivefold.elastic.report import render_report

        for line in render_report(summary["recovery"]):
            print(line)
    saves = ""
    if args.checkpoint_dir:
        blocked = summary["checkpoint_seconds"]["blocked"]  # per save: how long training waited for it
        saves = (f"; checkpoints in {args.checkpoint_dir} (training waited {sum(blocked):.2f} s for "
                 f"{len(blocked)} save(s))")
    print(f"done: {summary['steps']} steps of {summary['plan']}, final loss {summary['final_loss']:.4f}, "
          f"{summary['tokens_per_s']:,.0f} tok/s, mfu {100 * summary['mfu']:.2f}%, "
          f"peak memory {summary['peak_memory_gib']:.2f} GiB"
          + (f"; metrics in {args.metrics_file}" if args.metrics_file else "") + saves)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from rich.progress import Progress
    from rich.table import Table

    from fivefold.profile.collectives import COLLECTIVES, message_sizes
    from fivefold.profile.kernels import gemm_shapes
    from fivefold.profile.run import run_profile

    if args.nproc < 1:
        raise SpecError("--nproc", args.nproc, "must be at least 1 (2 or more also measures collectives)")
    dtypes = 3 if _cuda_available() else 2
    total = dtypes * len(gemm_shapes(args.quick)) + 1
    if args.nproc > 1:
        total += len(COLLECTIVES) * len(message_sizes(args.quick))
    with Progress(console=console_err(), transient=True, disable=args.json) as progress:
        task = progress.add_task("profiling", total=total)

        def on_step(kind: str, item: object) -> None:
            what = {"gemm": lambda p: f"GEMM {p.m}x{p.n}x{p.k} {p.dtype}", "memory": lambda p: "memory bandwidth",
                    "collective": lambda p: f"{p.collective} {p.message_bytes} B"}[kind](item)
            progress.update(task, advance=1, description=what)

        profile = run_profile(args.nproc, args.quick, on_step=on_step)
    profile.save(args.out)
    if args.json:
        print_json({**profile.to_dict(), "out": args.out})
        return 0
    out = console()
    table = Table(title=f"fivefold profile: {profile.device}, {profile.processes} processes", box=None)
    for column in ("what", "measured"):
        table.add_column(column)
    for dtype, flops in profile.peak_flops().items():
        table.add_row(f"best GEMM {dtype}", f"{flops / 1e12:.3g} TFLOP/s")
    table.add_row("memory bandwidth", f"{profile.memory_bandwidth / 1e9:.3g} GB/s")
    for collective in COLLECTIVES:
        points = [p for p in profile.collectives if p.collective == collective]
        if points:
            table.add_row(f"{collective}", f"{points[-1].bus_bandwidth / 1e9:.3g} GB/s bus at "
                          f"{points[-1].message_bytes >> 20} MiB, {points[0].seconds * 1e6:.0f} us at "
                          f"{points[0].message_bytes >> 10} KiB")
    out.print(table)
    out.print(f"wrote {args.out}; use it with --cluster {args.out}")
    return 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def console_err():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def cmd_report(args: argparse.Namespace) -> int:
    from fivefold.report import report_run

    report = report_run(args.run, args.stack)
    if args.json:
        print_json(report.to_dict())
        return 0
    from fivefold.report.render import report_renderables

    out = console()
    for renderable in report_renderables(report):
        out.print(renderable, soft_wrap=isinstance(renderable, str))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    if bool(args.from_hf) == bool(args.to_hf):
        raise SpecError("--from-hf/--to-hf", args.from_hf or args.to_hf, "give exactly one of the two")
    if not args.out:
        raise SpecError("--out", None, "required: the checkpoint (with --from-hf) or folder (with --to-hf) to write")
    from fivefold.checkpoint.hf import convert_from_hf, convert_to_hf
    from fivefold.checkpoint.layout import read_checkpoint_info

    if args.from_hf:
        out = convert_from_hf(args.from_hf, args.out)
        spec, kind = read_checkpoint_info(out)["model"], "fivefold checkpoint"
    else:
        out = convert_to_hf(args.to_hf, args.out)
        from fivefold.checkpoint.hf import read_hf_config

        spec, kind = read_hf_config(out)[1], "Hugging Face Llama folder"
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    if args.json:
        print_json({"out": str(out), "kind": kind, "model": spec.to_dict(), "params": spec.num_params(),
                    "files": files})
    else:
        console().print(f"wrote {kind} [bold]{out}[/]: {spec.layers} layers, hidden {spec.hidden}, "
                        f"vocab {spec.vocab}, {spec.num_params():,} parameters", soft_wrap=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    p.add_argument("--top", type=int, default=5, help="how many plans to show (default: 5)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of device memory kept free (default: 0.1)")
    p.add_argument("--out", default=None, help="write the best plan to this TOML file")
    p.add_argument("--simulate-top", type=int, default=0, help="re-rank the best N by simulation")
    add_stack_flag(p)
    add_json_flag(p)

    p = verb("estimate", "predict step time, throughput, memory and bubble of one plan", cmd_estimate)
    add_spec_flags(p)
    add_layout_flags(p)
    add_stack_flag(p)
    add_json_flag(p)

    p = verb("simulate", "replay one step of a plan rank by rank; write a trace and a timeline picture",
             cmd_simulate)
    add_spec_flags(p)
    add_layout_flags(p)
    p.add_argument("--out-dir", default="out/simulate", help="where to write trace.json and timeline.png")
    p.add_argument("--stage-time", action="append", default=[], metavar="STAGE=SCALE",
                   help="what-if: scale the compute time of one stage (repeatable), e.g. 0=1.5")
    add_json_flag(p)

    p = verb("train", "run a plan with torch.distributed (gloo on CPU, NCCL on GPU)", cmd_train)
    p.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)  # set by the torchrun line
    add_spec_flags(p)
    add_layout_flags(p)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default: 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data order (default: 0)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument("--warmup-steps", type=int, default=2, help="linear warmup steps (default: 2)")
    p.add_argument("--data", default=None, help="token file (.bin/.npy) or text file; default: built-in corpus")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer.json; default: byte-level")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: auto")
    p.add_argument("--nproc", type=int, default=None, help="worker processes (default: the plan's world size)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (default: 1.0)")
    p.add_argument("--metrics-file", default=None,
                   help="append one JSON line per step here; its folder also gets plan.toml")
    p.add_argument("--checkpoint-dir", default=None,
                   help="folder of step-XXXXXXXX checkpoints (saved in the background; always after the last step)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also save every K steps (default: 0, only at the end)")
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints kept (default: 3)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir, under any plan")
    p.add_argument("--init-from-hf", default=None,
                   help="initial weights from a local Hugging Face Llama folder (its config.json sets the model)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restarts after a worker dies; each resumes from the newest complete checkpoint (default: 0)")
    p.add_argument("--max-loss-spike", type=float, default=3.0, help="skip the update when the loss exceeds "
                   "FACTOR x the running median of recent losses; 0 disables (default: 3.0)")
    p.add_argument("--max-bad-steps", type=int, default=3, help="after K bad steps in a row (NaN/Inf or spike), "
                   "roll back to the newest checkpoint and skip those batches; 0 = never (default: 3)")
    p.add_argument("--straggler-factor", type=float, default=1.5, help="report a rank whose compute is this "
                   "much slower than the median rank's; 0 disables (default: 1.5)")
    p.add_argument("--straggler-patience", type=int, default=3,
                   help="... for this many steps in a row (default: 3)")
    p.add_argument("--collective-timeout", type=float, default=600.0, help="seconds a collective waits for a "
                   "peer before the step fails with an error (default: 600)")
    p.add_argument("--trace", action="store_true", help="record a per-rank timeline for `fivefold report`")
    add_json_flag(p)

    p = verb("profile", "measure this machine: GEMMs, memory bandwidth, collectives", cmd_profile)
    p.add_argument("--quick", action="store_true", help="a small grid, under a minute")
    p.add_argument("--nproc", type=int, default=2, help="processes for the collective measurements")
    p.add_argument("--out", default="profile.toml", help="profile file (accepted by --cluster)")
    add_json_flag(p)

    p = verb("report", "compare what a run's plan predicted with what the run measured", cmd_report)
    p.add_argument("run", help="run folder (with plan.toml and metrics.jsonl) or a metrics file")
    p.add_argument("--stack", default=None, help="software the cost model assumes (default: fivefold, the "
                   "runtime's own, when the cost model has it, else modern)")
    add_json_flag(p)

    p = verb("convert", "convert checkpoints to and from Hugging Face format", cmd_convert)
    p.add_argument("--from-hf", default=None, help="a local Hugging Face Llama folder to import")
    p.add_argument("--to-hf", default=None, help="a fivefold checkpoint to export")
    p.add_argument("--out", required=False, default=None, help="output checkpoint or folder")
    add_json_flag(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except NotBuilt as exc:
        print(f"not built: {exc}", file=sys.stderr)
        return EXIT_NOT_BUILT
    except FivefoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
