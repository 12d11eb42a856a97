"""`plan/estimate/simulate --serve`: the serving side of those verbs (parsing and printing; the work lives in
cost/deployment.py, cost/serving_estimate.py, sim/serving.py and planner/serving.py). No torch here."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable

from fivefold.errors import SpecError
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.serve import BatchLimits, ServeLayout, check_gpu_memory_utilization
from fivefold.spec.workload import Workload, load_trace, parse_length, parse_rate


@dataclass
class ServeInputs:
    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    dtype: str
    kv_dtype: str
    limits: BatchLimits
    kv_blocks: int | None  # --kv-blocks
    kv_memory_gib: float | None  # --kv-memory


# The serving flags and their defaults (flags.add_workload_flags, add_serve_layout_flags).
SERVE_ONLY = {"prompt_len": "512", "output_len": "128", "trace": None, "rate": None, "batch": None, "requests": 1000,
              "ttft_slo": None, "tpot_slo": None, "replicas": None, "max_batch": None, "max_tokens_per_step": None,
              "kv_blocks": None, "kv_memory": None, "kv_dtype": None}


def check_serve_only_flags(args: argparse.Namespace) -> None:
    """A serving flag without --serve would be ignored silently: refuse it."""
    for name, default in SERVE_ONLY.items():
        if hasattr(args, name) and getattr(args, name) != default:
            raise SpecError("--" + name.replace("_", "-"), getattr(args, name),
                            "is a serving flag; add --serve (or drop it)")


def workload_from_args(args: argparse.Namespace) -> Workload:
    trace = load_trace(args.trace) if args.trace else ()
    return Workload(prompt_len=parse_length(args.prompt_len, "--prompt-len"),
                    output_len=parse_length(args.output_len, "--output-len"), rate=parse_rate(args.rate),
                    batch=args.batch, ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo, trace=trace,
                    num_requests=args.requests)


def serve_inputs_from_args(args: argparse.Namespace) -> ServeInputs:
    """Model, cluster, workload and limits from the flags; every check before any work."""
    from fivefold.flags import default_cluster
    from fivefold.spec import default_dtype, parse_cluster, parse_model

    model = parse_model(args.model)
    cluster = parse_cluster(args.cluster or default_cluster(args))
    workload = workload_from_args(args)
    dtype = args.dtype or default_dtype(cluster)
    kv_dtype = args.kv_dtype or ("bf16" if dtype == "fp8" else dtype)
    if args.kv_blocks is not None and args.kv_memory is not None:
        raise SpecError("--kv-blocks", args.kv_blocks, "give --kv-blocks or --kv-memory, not both")
    if args.gpu_memory_utilization is not None:
        check_gpu_memory_utilization(args.gpu_memory_utilization)
    if args.kv_memory is not None and not (math.isfinite(args.kv_memory) and args.kv_memory > 0):
        raise SpecError("--kv-memory", args.kv_memory, "must be a positive number of GiB")
    limits = BatchLimits(max_batch=_given(args.max_batch, 256), max_tokens_per_step=_given(args.max_tokens_per_step,
                                                                                            2048),
                         kv_blocks=_given(args.kv_blocks, 1024))
    return ServeInputs(model, cluster, workload, dtype, kv_dtype, limits, args.kv_blocks, args.kv_memory)


def layout_from_args(args: argparse.Namespace, inputs: ServeInputs) -> ServeLayout:
    return ServeLayout(tp=_given(args.tp, 1), pp=_given(args.pp, 1), replicas=_given(args.replicas, 1),
                       ep=_given(args.ep, 1), dtype=inputs.dtype, kv_dtype=inputs.kv_dtype, limits=inputs.limits)


def _given(value: int | None, default: int) -> int:
    """A flag's value when given (0 included: the spec refuses it by name), else the default."""
    return default if value is None else value


def _time(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "unbounded (saturated)"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


STEP_LABELS = {"gemm_s": "linear layers (GEMMs: weights read / FLOPs)", "attention_s": "attention (KV read, prefill)",
               "tp_comm_s": "tensor-parallel all-reduces", "other_s": "element-wise + LM head",
               "pp_send_s": "pipeline transfer", "host_s": "engine host work per step",
               "stage_host_s": "engine host work per layer (measured: eager modules, attention calls)"}


def estimate_renderables(layout: ServeLayout, inputs: ServeInputs, estimate: Any) -> list:
    """Summary and where one step's time goes."""
    from rich.table import Table

    w = inputs.workload
    title = (f"{inputs.model.name} served on {inputs.cluster.label}: tp={layout.tp} pp={layout.pp} "
             f"replicas={layout.replicas}" + (f" ep={layout.ep}" if layout.ep > 1 else "") +
             f", {layout.dtype} (KV {layout.kv_dtype}); {w.describe()}")
    summary = Table(title=title, show_header=False, title_justify="left")
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    summary.add_row("TTFT mean / p90", f"{_time(estimate.ttft_s)} / {_time(estimate.ttft_p90_s)}")
    summary.add_row("TPOT mean / p90", f"{_time(estimate.tpot_s)} / {_time(estimate.tpot_p90_s)}")
    summary.add_row("output tokens/s", f"{estimate.output_tokens_per_s:,.0f}  ({estimate.requests_per_s:.2f} "
                    f"requests/s; {estimate.output_tokens_per_s / estimate.devices:,.0f} per device)")
    first = estimate.replicas[0]
    summary.add_row("requests running", f"{first.running:.1f} per replica (at most {first.max_running:.0f}: "
                    "max batch, KV blocks, token budget)")
    summary.add_row("KV cache", f"{estimate.kv_tokens:,} tokens per replica")
    summary.add_row("memory per device", f"{estimate.memory_gib:.1f} GiB")
    summary.add_row("decode turns compute-bound", f"at ~{estimate.crossover_batch:.0f} tokens per step")
    if w.has_targets:
        verdict = "[green]meets[/green]" if estimate.meets(w) else "[red]misses[/red]"
        summary.add_row("latency targets (p90)", f"{verdict} TTFT {_time(w.ttft_slo)}, TPOT {_time(w.tpot_slo)}")
    step = first.stage
    breakdown = Table(title=f"where a step's time goes (busiest stage, {first.running / layout.pp:.0f} requests "
                      "per step)", title_justify="left")
    breakdown.add_column("part")
    breakdown.add_column("time", justify="right")
    breakdown.add_column("share", justify="right")
    for key, label in STEP_LABELS.items():
        seconds = getattr(step, key)
        if seconds > 0:
            breakdown.add_row(label, _time(seconds), f"{seconds / step.stage_s:.1%}")
    if layout.pp > 1:
        breakdown.add_row("step latency through all stages", _time(step.latency_s), "")
    return [summary, breakdown]


def cmd_estimate_serve(args: argparse.Namespace, console: Callable[[], Any], print_json: Callable[[Any], None]) -> int:
    """`estimate --serve`; `console` and `print_json` are the CLI's (cli.py imports this module)."""
    from fivefold.cost.deployment import place
    from fivefold.cost.serving_estimate import estimate_serving

    inputs = serve_inputs_from_args(args)
    layout = layout_from_args(args, inputs)
    replicas = place(inputs.model, inputs.cluster, layout, inputs.kv_blocks, inputs.kv_memory_gib)
    estimate = estimate_serving(replicas, inputs.limits, inputs.workload, layout.pp)
    if args.json:
        print_json({"model": inputs.model.name, "cluster": inputs.cluster.label,
                    "layout": {"tp": layout.tp, "pp": layout.pp, "replicas": layout.replicas, "ep": layout.ep,
                               "dtype": layout.dtype, "kv_dtype": layout.kv_dtype},
                    "workload": inputs.workload.to_dict(), **estimate.to_dict(),
                    "meets_targets": estimate.meets(inputs.workload) if inputs.workload.has_targets else None})
        return 0
    out = console()
    for renderable in estimate_renderables(layout, inputs, estimate):
        out.print(renderable)
    return 0


def cmd_simulate_serve(args: argparse.Namespace, console: Callable[[], Any], print_json: Callable[[Any], None]) -> int:
    """Replay the stream through the scheduler; per-request percentiles beside the estimate; PNG and trace."""
    from fivefold.cost.deployment import place
    from fivefold.cost.serving_estimate import estimate_serving
    from fivefold.outputs import check_output_dir, make_dir
    from fivefold.sim.serving import simulate_serving
    from fivefold.sim.serving_outputs import write_serving_png, write_serving_trace

    inputs = serve_inputs_from_args(args)
    layout = layout_from_args(args, inputs)
    check_output_dir(args.out_dir, "--out-dir")
    replicas = place(inputs.model, inputs.cluster, layout, inputs.kv_blocks, inputs.kv_memory_gib)
    estimate = estimate_serving(replicas, inputs.limits, inputs.workload, layout.pp)
    result = simulate_serving(replicas, inputs.limits, inputs.workload, layout.pp)
    result.title = (f"{inputs.model.name} on {inputs.cluster.label}: tp={layout.tp} pp={layout.pp} "
                    f"replicas={layout.replicas}; {inputs.workload.describe()}")
    out_dir = make_dir(args.out_dir, "--out-dir")
    trace_path = write_serving_trace(result, out_dir / "serve_trace.json")
    png_path = write_serving_png(result, out_dir / "serve_timeline.png")
    summary = result.to_dict()
    if args.json:
        print_json({**summary, "estimate": estimate.to_dict(), "trace": str(trace_path), "timeline": str(png_path)})
        return 0
    from rich.table import Table

    table = Table(title=result.title, title_justify="left")
    for column in ("", "mean", "p50", "p90", "p99", "estimate mean / p90"):
        table.add_column(column, justify="right" if column else "left")
    for name, label, est in (("ttft_s", "TTFT", (estimate.ttft_s, estimate.ttft_p90_s)),
                             ("tpot_s", "TPOT", (estimate.tpot_s, estimate.tpot_p90_s)),
                             ("latency_s", "request latency", None)):
        values = summary[name]
        table.add_row(label, *(_time(values[k]) for k in ("mean", "p50", "p90", "p99")),
                      f"{_time(est[0])} / {_time(est[1])}" if est else "")
    out = console()
    out.print(table)
    out.print(f"{summary['output_tokens_per_s']:,.0f} output tokens/s ({summary['requests_per_s']:.2f} requests/s; "
              f"estimate {estimate.output_tokens_per_s:,.0f}) over {summary['duration_s']:.1f} s simulated, "
              f"{summary['steps']:,} steps, {summary['preemptions']} preemptions")
    out.print(f"trace: {trace_path}  (open in https://ui.perfetto.dev)\npicture: {png_path}", soft_wrap=True)
    return 0


def explain_winner(candidates: list, workload: Workload) -> list[str]:
    """Why the first candidate wins, or why nothing meets the targets."""
    best = candidates[0]
    lay, est = best.layout, best.estimate
    step = est.replicas[0].stage
    heaviest = max(STEP_LABELS, key=lambda key: getattr(step, key))
    lines = []
    if workload.has_targets and not best.meets:
        lines.append("No layout meets the targets. Closest splits:")
        seen = set()
        for c in candidates:
            key = (c.layout.tp, c.layout.pp)
            if key not in seen and len(seen) < 3:
                seen.add(key)
                lines.append(f"  tp={c.layout.tp} pp={c.layout.pp}: {c.reason}")
        lines.append("Loosen a target, lower the rate, add devices, or use --dtype fp8 (H100 and newer).")
        return lines
    share = getattr(step, heaviest) / step.stage_s
    devices = f"{lay.tp * lay.pp} device(s) per replica, {lay.replicas} replica(s)"
    if workload.has_targets:
        lines.append(f"Best: tp={lay.tp} pp={lay.pp} x {lay.replicas} ({devices}): both p90 targets hold up to "
                     f"{best.goodput_rps:.2f} requests/s, {best.score:.3f} requests/s per device; "
                     f"TTFT p90 {_time(est.ttft_p90_s)}, TPOT p90 {_time(est.tpot_p90_s)} at the offered load.")
    else:
        lines.append(f"Best: tp={lay.tp} pp={lay.pp} x {lay.replicas} ({devices}): {best.score:,.0f} output "
                     "tokens/s per device at saturation.")
    lines.append(f"A step of {est.replicas[0].running / lay.pp:.3g} requests spends {share:.0%} on "
                 f"{STEP_LABELS[heaviest]}; decode turns compute-bound at ~{est.crossover_batch:.0f} tokens per "
                 f"step; the KV cache holds {est.kv_tokens:,} tokens per replica.")
    rival = next((c for c in candidates[1:] if (c.layout.tp, c.layout.pp) != (lay.tp, lay.pp)), None)
    if rival is not None:
        lines.append(f"Next split, tp={rival.layout.tp} pp={rival.layout.pp}: " + (
            f"score {rival.score:.3g} ({rival.reason})" if rival.reason else f"score {rival.score:.3g}") + ".")
    return lines


def cmd_plan_serve(args: argparse.Namespace, console: Callable[[], Any], print_json: Callable[[Any], None]) -> int:
    """`plan --serve`: search the splits and limits, rank, explain."""
    from fivefold.planner.serving import search_serving

    inputs = serve_inputs_from_args(args)
    fixed = {"tp": args.tp, "pp": args.pp, "ep": args.ep, "replicas": args.replicas, "max_batch": args.max_batch,
             "max_tokens_per_step": args.max_tokens_per_step}
    for flag, value in fixed.items():
        if value is not None and value < 1:
            raise SpecError(f"--{flag.replace('_', '-')}", value, "must be at least 1")
    candidates = search_serving(inputs.model, inputs.cluster, inputs.workload, inputs.dtype, inputs.kv_dtype, fixed,
                                inputs.kv_blocks, inputs.kv_memory_gib)
    explanation = explain_winner(candidates, inputs.workload)
    if args.json:
        print_json({"model": inputs.model.name, "cluster": inputs.cluster.label,
                    "workload": inputs.workload.to_dict(), "explanation": explanation,
                    "candidates": [c.to_dict() for c in candidates[:max(args.top, 1) * 4]]})
        return 0
    from rich.table import Table

    table = Table(title=f"{inputs.model.name} on {inputs.cluster.label}: {inputs.workload.describe()} "
                  f"({len(candidates)} layouts)", title_justify="left")
    for column in ("tp", "pp", "replicas", "max batch", "chunk", "TTFT p90", "TPOT p90", "req/s",
                   "score", "meets"):
        table.add_column(column, justify="right")
    for c in candidates[:args.top]:
        lay, est = c.layout, c.estimate
        table.add_row(str(lay.tp), str(lay.pp), str(lay.replicas), str(lay.limits.max_batch),
                      str(lay.limits.max_tokens_per_step), _time(est.ttft_p90_s), _time(est.tpot_p90_s),
                      f"{est.requests_per_s:.2f}", f"{c.score:.3g}", "yes" if c.meets else "no")
    out = console()
    out.print(table)
    out.print("score: " + ("goodput, requests/s per device meeting both p90 targets" if inputs.workload.has_targets
                           else "output tokens/s per device at saturation"))
    for line in explanation:
        style = "red" if line.startswith("No layout meets") else None
        out.print(line, soft_wrap=True, style=style, markup=False)
    return 0


def cmd_report_serve(args: argparse.Namespace, console: Callable[[], Any], print_json: Callable[[Any], None]) -> int:
    """`fivefold report RUN` on a serving run folder (generate or serve --metrics-file): predicted against
    measured."""
    from fivefold.report.serving import serving_renderables, serving_report, serving_run_file

    served = serving_report(serving_run_file(args.run))
    if args.json:
        print_json(served.to_dict())
        return 0
    out = console()
    for renderable in serving_renderables(served):
        out.print(renderable, soft_wrap=isinstance(renderable, str))
    return 0
