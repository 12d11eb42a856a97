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
    group.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                       help="compute dtype (default: fp32 on cpu clusters, bf16 otherwise)")


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
    from rich.console import Console

    return Console(stderr=False, highlight=False)


# --- verbs -------------------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> int:
    raise NotBuilt("fivefold plan: the planner is not built yet (issue 3)")


def cmd_estimate(args: argparse.Namespace) -> int:
    raise NotBuilt("fivefold estimate: the cost model is not built yet (issue 3)")


def cmd_simulate(args: argparse.Namespace) -> int:
    raise NotBuilt("fivefold simulate: the simulator is not built yet (issue 5)")


def cmd_train(args: argparse.Namespace) -> int:
    raise NotBuilt("fivefold train: the runtime is not built yet (issue 4)")


def cmd_profile(args: argparse.Namespace) -> int:
    raise NotBuilt("fivefold profile: hardware profiling is not built yet (issue 9)")


def cmd_report(args: argparse.Namespace) -> int:
    raise NotBuilt("fivefold report: predicted-vs-measured reports are not built yet (issue 9)")


def cmd_convert(args: argparse.Namespace) -> int:
    raise NotBuilt("fivefold convert: checkpoint conversion is not built yet (issue 6)")


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
    add_json_flag(p)

    p = verb("estimate", "predict step time, throughput, memory and bubble of one plan", cmd_estimate)
    add_spec_flags(p)
    add_layout_flags(p)
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
    p.add_argument("--metrics-file", default=None, help="append one JSON line per step here")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every K steps (0 = never)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (default: 3)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--init-from-hf", default=None, help="start from a local Hugging Face Llama folder")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts after a worker dies (default: 0)")
    p.add_argument("--trace", action="store_true", help="record a per-rank timeline for `fivefold report`")
    add_json_flag(p)

    p = verb("profile", "measure this machine: GEMMs, memory bandwidth, collectives", cmd_profile)
    p.add_argument("--quick", action="store_true", help="a small grid, under a minute")
    p.add_argument("--nproc", type=int, default=2, help="processes for the collective measurements")
    p.add_argument("--out", default="profile.toml", help="profile file (accepted by --cluster)")
    add_json_flag(p)

    p = verb("report", "compare what a run's plan predicted with what the run measured", cmd_report)
    p.add_argument("run", help="run folder (with plan.toml and metrics.jsonl) or a metrics file")
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
