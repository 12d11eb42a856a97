"""The flags several verbs share, and what they describe: the model, cluster and training (`add_spec_flags`),
the layout (`add_layout_flags`; spec/layout.py fills in what is not given), the software stack, --json, and
the run flags of `train` (`add_run_flags`: RunConfig's fields, runtime/config.py). Parsing only: argparse and
the spec/ parsers; nothing here imports torch, so `fivefold plan` starts fast.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from fivefold.spec.job import resume_mode, seconds_or_off
from fivefold.spec.serve import GPU_MEMORY_UTILIZATION

if TYPE_CHECKING:
    from fivefold.cost.stack import SoftwareStack
    from fivefold.spec import ClusterSpec, ModelSpec, Plan, TrainSpec
    from fivefold.spec.diloco import DiLoCoSpec


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """--model/--cluster/--seq-len/--global-batch/--dtype: what to train and where."""
    group = parser.add_argument_group("what and where")
    group.add_argument("--model", default="tiny", help="preset name, TOML file, or inline "
                       "layers=..,hidden=..,heads=..,vocab=..[,mlp=gelu] (default: tiny)")
    group.add_argument("--cluster", default=None,
                       help="NODESxGPUSxDEVICE[:nvlink=..,nic=..] groups joined by '+', or a TOML file "
                            "(default: 1xNxcpu, N = --nproc or the degrees given, else 4)")
    group.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    group.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step (default: 8)")
    group.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "fp8"], default=None,
                       help="compute dtype (default: fp32 on cpu clusters, bf16 otherwise); fp8: FP8 GEMMs, "
                            "BF16 elsewhere (H100 and newer)")
    group.add_argument("--expert-imbalance", type=float, default=1.0,
                       help="MoE: tokens of the busiest rank's experts over the mean, for the cost model "
                            "(default: 1, balanced)")
    group.add_argument("--document-mask", action="store_true", default=False,
                       help="packed documents: positions restart and attention stays inside each document "
                            "(split at the tokenizer's end-of-document token)")


def add_layout_flags(parser: argparse.ArgumentParser, for_search: bool = False) -> None:
    """Degrees and the rest of a layout. In `plan` each fixes that choice of the search."""
    group = parser.add_argument_group("layout" + (" (each one given fixes that choice in the search)"
                                                  if for_search else ""))
    for dim, text in (("dp", "data-parallel"), ("tp", "tensor-parallel"), ("pp", "pipeline-parallel"),
                      ("cp", "context-parallel"), ("ep", "expert-parallel (MoE; folded over tp x cp x dp)"),
                      ("etp", "expert tensor-parallel (MoE: each expert's matrices split over this many ranks)")):
        default_text = "" if for_search else (" (default: world / (tp*pp*cp))" if dim == "dp" else " (default: 1)")
        group.add_argument(f"--{dim}", type=int, default=None, help=f"{text} degree{default_text}")
    group.add_argument("--cp-method", choices=["allgather", "ulysses"], default=None,
                       help="context parallel: all-gather K/V (Llama 3) or all-to-all heads (Ulysses) "
                            "(default: allgather)")
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
    group.add_argument("--vocab-parallel", action=argparse.BooleanOptionalAction, default=None,
                       help="embedding, LM head and loss split over the pp ranks (Yeung et al. 2024; needs pp > 1) "
                            "(default: off)")
    group.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                       help="ZeRO level; 3 = FSDP (default: 0)")
    if not for_search:
        group.add_argument("--plan", default=None, help="a plan TOML file (replaces all the flags above)")


def add_stack_flag(parser: argparse.ArgumentParser) -> None:
    from fivefold.cost.stack import DEFAULT_STACK, stack_help

    parser.add_argument("--stack", default=DEFAULT_STACK, help="software the cost model assumes, and what it can run "
                        "(default: fivefold, what `fivefold train` runs). " + stack_help())
    parser.add_argument("--fp8-recipe", default=None, metavar="RECIPE",
                        help="FP8 scaling with --dtype fp8: tensorwise (default) or rowwise (torchao Float8), "
                             "current, delayed or blockwise (Transformer Engine); cost/fp8.py")


def stack_of_args(args: argparse.Namespace) -> SoftwareStack:
    """The --stack preset with --fp8-recipe applied."""
    from fivefold.cost.fp8 import with_fp8_recipe
    from fivefold.cost.stack import stack_named

    return with_fp8_recipe(stack_named(args.stack), getattr(args, "fp8_recipe", None))


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")


LAYOUT_FLAGS = ("dp", "tp", "pp", "cp", "cp_method", "ep", "etp", "zero", "micro_batch", "schedule", "virtual_stages",
                "recompute", "sequence_parallel", "vocab_parallel")


# The layout flags a re-plan on another world size keeps (elastic/replan.py drops degrees that no longer fit).
REPLAN_KEEPS = ("dp", "tp", "pp", "micro_batch", "schedule", "virtual_stages", "recompute", "zero", "sequence_parallel")


def layout_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The layout flags as given (None = not given), keyed like Plan's fields."""
    from fivefold.spec import parse_layers_per_stage

    return {**{name: getattr(args, name) for name in LAYOUT_FLAGS},
            "layers_per_stage": parse_layers_per_stage(args.layers_per_stage)}


def specs_from_args(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec, TrainSpec]:
    """(ModelSpec, ClusterSpec, TrainSpec) from the shared flags."""
    from fivefold.spec import TrainSpec, default_dtype, parse_cluster, parse_model

    model = parse_model(args.model)
    cluster = parse_cluster(args.cluster or default_cluster(args))
    train = TrainSpec(seq_len=args.seq_len, global_batch=args.global_batch, dtype=args.dtype or default_dtype(cluster),
                      expert_imbalance=getattr(args, "expert_imbalance", 1.0),
                      document_mask=getattr(args, "document_mask", False))
    if train.expert_imbalance != 1.0 and not model.is_moe:
        from fivefold.errors import SpecError

        raise SpecError("--expert-imbalance", train.expert_imbalance, f"means nothing for a dense model ({model.name} "
                        "has no experts); leave it out")
    return model, cluster, train


def default_cluster(args: argparse.Namespace) -> str:
    """No --cluster: this machine's CPU workers, as many as --nproc says (train), else as many as the
    degrees given need when --dp is among them, else 4."""
    from fivefold.errors import SpecError

    nproc = getattr(args, "nproc", None)
    if nproc is not None:
        if nproc < 1:
            raise SpecError("--nproc", nproc, "must be at least 1")
        from fivefold.runtime.launch import check_local_workers

        check_local_workers(nproc, "--nproc")
        return f"1x{nproc}xcpu"
    if getattr(args, "dp", None) is not None:
        world = 1
        for degree in (getattr(args, d, None) for d in ("dp", "tp", "pp", "cp")):
            if degree is not None:
                if degree < 1:
                    return "1x4xcpu"  # the layout names the bad degree
                world *= degree
        return f"1x{world}xcpu"
    return "1x4xcpu"


def plan_from_args(args: argparse.Namespace) -> Plan:
    """A Plan from --plan FILE, or from the spec and layout flags (spec/layout.py fills in the rest)."""
    from fivefold.spec import layout_plan, load_plan

    if getattr(args, "plan", None):
        return load_plan(args.plan)
    return layout_plan(*specs_from_args(args), **layout_from_args(args))


def vocab_fixed_by(args: argparse.Namespace) -> str | None:
    """What gave the model's vocab, when something did: a plan file, a Hugging Face folder, or --model with a
    vocab of its own (inline or in its TOML file). None: the preset's, which --tokenizer may replace."""
    from fivefold.spec.model import PRESETS
    from fivefold.spec.units import read_toml_file

    if getattr(args, "plan", None):
        return f"the plan file {args.plan}"
    if getattr(args, "init_from_hf", None):
        return f"the Hugging Face model {args.init_from_hf}"
    text = str(args.model).strip()
    if text in PRESETS:
        return None
    if text.endswith(".toml"):
        data = read_toml_file(text, "--model")
        return f"--model {text}" if "vocab" in data.get("model", data) else None
    keys = {item.partition("=")[0].strip() for item in text.split(",")}
    return "--model" if "vocab" in keys else None


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The `train` flags of the run (each one a field of RunConfig in runtime/config.py, with the same default)
    and of its launch on this machine (--nproc, --max-restarts)."""
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default: 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data order (default: 0)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument("--warmup-steps", type=int, default=2, help="linear warmup steps (default: 2)")
    p.add_argument("--data", default=None, help="token file (.bin/.npy) or folder of shards, .txt, .jsonl or "
                   ".parquet file or folder, a `datasets` save_to_disk folder, or a blend 0.7:web/,0.3:code.jsonl "
                   "(docs/data.md); default: built-in corpus")
    p.add_argument("--text-field", default="text", help="the column holding the text in JSONL, Parquet and "
                   "`datasets` rows (default: text); a source of --data may name its own: a.jsonl@content")
    p.add_argument("--data-change", choices=["refuse", "allow"], default="refuse",
                   help="a resumed run whose --data (sources, weights) differs from the checkpoint's: refuse "
                        "(default), or allow: the step and schedule continue, unchanged sources continue where they "
                        "were, new or changed ones start at their beginning (docs/data.md)")
    p.add_argument("--eval-data", default=None, help="validation data (any --data form): eval_loss and "
                   "eval_perplexity in the metrics (default: none)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="evaluate every N steps and after the last (default: 0, only after the last)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="global batches per evaluation, the same ones every time (default: 4)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer.json (or a folder holding one); sets the model's "
                   "vocab to its size rounded up to a multiple of 128 unless the model gives vocab; default: "
                   "byte-level, or the --init-from-hf folder's tokenizer")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: auto")
    p.add_argument("--nproc", type=int, default=None, help="worker processes (default: the plan's world size)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (default: 1.0)")
    p.add_argument("--metrics-file", default=None,
                   help="append one JSON line per step here; its folder also gets plan.toml")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write per-step scalars (loss, grad norm, lr, tokens/s, MFU, memory, per-rank step times) "
                        "as TensorBoard event files into DIR")
    p.add_argument("--wandb", default=None, metavar="PROJECT", help="log the same per-step scalars to Weights & "
                   "Biases project PROJECT (ENTITY/PROJECT also works; offline files in the run folder when there is "
                   "no network or WANDB_MODE=offline; needs the `tracking` extra)")
    p.add_argument("--profile-steps", default=None, metavar="A-B", help="torch.profiler over steps A to B on every "
                   "rank: RUN/profile/rank<R>-steps<A>-<B>.trace.json (Perfetto, chrome://tracing), on CUDA a memory "
                   "snapshot; needs --metrics-file")
    p.add_argument("--checkpoint-dir", default=None,
                   help="folder of step-XXXXXXXX checkpoints (saved in the background; always after the last step)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also save every K steps (default: 0, only at the end)")
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints kept (default: 3)")
    p.add_argument("--resume", nargs="?", const=True, default=False, type=resume_mode, metavar="auto",
                   help="continue from the newest complete checkpoint in --checkpoint-dir, under any plan; "
                        "--resume auto: the same, or a fresh start when there is none (one command for the first "
                        "run and every requeue)")
    p.add_argument("--overwrite", action="store_true", help="replace the metrics file (and the run folder's events, "
                   "trace and profiles) of another run instead of refusing it")
    p.add_argument("--save-on-term-within", type=seconds_or_off, default=None, metavar="SECONDS|off",
                   help="on SIGTERM, after the save in flight: save once more when the newest checkpoint is more "
                        "than SECONDS of steps behind (default: 0 under Slurm, off elsewhere)")
    p.add_argument("--term-grace", type=int, default=120, metavar="SECONDS",
                   help="seconds a run has after SIGTERM to end its step and save before it is killed: the launcher "
                        "waits this long for its workers, and --slurm asks for SIGTERM this long before the time "
                        "limit (default: 120)")
    p.add_argument("--init-from-hf", default=None,
                   help="initial weights from a local Hugging Face Llama, Mixtral or Qwen3-MoE folder (its config.json "
                   "sets the model)")
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
    p.add_argument("--metrics-every", type=int, default=10, help="gather per-rank memory and times every N steps "
                   "(and on the first, last, bad and straggler-suspect steps; default: 10)")
    p.add_argument("--lr-schedule", default="cosine", help="learning rate after the warmup: cosine, wsd "
                   "(warmup-stable-decay), linear or constant (default: cosine)")
    p.add_argument("--min-lr", type=float, default=None, help="where the decay ends (default: 10%% of --lr)")
    p.add_argument("--decay-steps", type=int, default=None,
                   help="wsd: the last steps that decay to --min-lr (default: 20%% of the steps after warmup)")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay of matrices; none on norms and biases (default: 0.1)")
    p.add_argument("--betas", default="0.9,0.95", help="AdamW betas (default: 0.9,0.95)")
    p.add_argument("--eps", type=float, default=1e-8, help="AdamW epsilon (default: 1e-8)")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block (CPU: inductor "
                   "needs a C compiler; the first steps pay the compile time)")
    p.add_argument("--expert-gemm", default="auto", help="MoE experts: auto (one torch._grouped_mm per projection on "
                   "CUDA sm90+ in bf16, a GEMM per expert elsewhere), grouped (also on CPU, in fp32) or loop "
                   "(default: auto)")
    p.add_argument("--fp8-recipe", default=None, metavar="RECIPE", help="with --dtype fp8: tensorwise (default) or "
                   "rowwise scaling of the FP8 GEMMs (torchao's recipes; runtime/float8.py)")
    add_diloco_flags(p)


def add_slurm_flags(p: argparse.ArgumentParser) -> None:
    """What `--slurm` passes to sbatch as it is (the job file's [slurm] section)."""
    group = p.add_argument_group("with --slurm: passed to sbatch")
    group.add_argument("--time", default=None, help="the job's time limit, Slurm's forms: MINUTES, HH:MM:SS, "
                       "DAYS-HH[:MM[:SS]]")
    group.add_argument("--partition", default=None, help="the Slurm partition")
    group.add_argument("--account", default=None, help="the Slurm account charged")
    group.add_argument("--output", default=None, help="the job's log file (Slurm patterns such as %%j work; default: "
                       "Slurm's slurm-%%j.out)")


def diloco_of_args(args: argparse.Namespace, plan: Plan) -> DiLoCoSpec | None:
    """The DiLoCo flags of `estimate` checked as `train` checks them; None with --dp-sync sync."""
    from fivefold.spec.diloco import DILOCO_FLAGS, check_diloco_flags, spec_from_flags

    flags = {name: getattr(args, name) for name in DILOCO_FLAGS}
    check_diloco_flags(flags)
    return spec_from_flags(flags, plan)


def add_diloco_flags(p: argparse.ArgumentParser) -> None:
    """--dp-sync and the DiLoCo / Streaming DiLoCo flags of `train` (runtime/diloco.py, docs/low-bandwidth.md)."""
    p.add_argument("--dp-sync", choices=["sync", "diloco"], default="sync",
                   help="sync: sum gradients over dp every step (default); diloco: outer groups of dp replicas "
                        "train on their own and exchange an outer gradient every --sync-every steps")
    p.add_argument("--sync-every", type=int, default=50, help="DiLoCo H: inner steps between syncs (default: 50)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo outer SGD learning rate (default: 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="DiLoCo outer Nesterov momentum (default: 0.9)")
    p.add_argument("--fragments", type=int, default=1,
                   help="Streaming DiLoCo: fragments synced in turn, each on its own step of H (default: 1)")
    p.add_argument("--overlap", type=int, default=0,
                   help="Streaming DiLoCo: steps a fragment's exchange overlaps compute before it is applied (default: 0)")
    p.add_argument("--outer-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the exchanged outer gradients (default: fp32)")
    p.add_argument("--diloco-groups", type=int, default=0, help="outer replicas (a divisor of dp); default: the "
                   "cluster's + groups the dp replicas fall into, else 2")


def add_serve_layout_flags(parser: argparse.ArgumentParser, for_search: bool = False,
                           skip: tuple[str, ...] = ()) -> None:
    """The serving layout (spec/serve.py ServeLayout and BatchLimits), named alike in `serve`, `generate` and
    `plan/estimate/simulate --serve`. In `plan --serve` each one given fixes that choice of the search.
    `skip`: degrees the parser already has (plan/estimate/simulate have --tp --pp --ep from add_layout_flags)."""
    group = parser.add_argument_group("serving layout" + (" (each one given fixes that choice in the search)"
                                                          if for_search else ""))
    for dim, text in (("tp", "tensor-parallel degree (heads and MLP split)"),
                      ("pp", "pipeline-parallel degree (layers split, pp batches in flight)"),
                      ("replicas", "copies of the model behind the router"),
                      ("ep", "MoE: experts split over the tp ranks (1 or tp)")):
        if dim in skip:
            continue
        parser_default = "" if for_search else " (default: 1)"
        group.add_argument(f"--{dim}", type=int, default=None, help=text + parser_default)
    group.add_argument("--max-batch", type=int, default=None,
                       help="requests running at once per replica (default: 256)")
    group.add_argument("--max-tokens-per-step", type=int, default=None,
                       help="tokens one step computes, decodes plus prefill chunks (default: 2048)")
    group.add_argument("--kv-blocks", type=int, default=None,
                       help="KV-cache blocks per replica (16 tokens each); or give --kv-memory")
    group.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                       help="GiB of KV cache per device (the blocks follow from the model and layout)")
    group.add_argument("--kv-dtype", choices=["bf16", "fp16", "fp32", "fp8"], default=None,
                       help="KV-cache dtype (default: the compute dtype)")
    group.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                       help="GPU: the fraction of each device's memory the weights, activations and KV cache may "
                            "use; the KV cache takes what is left of it after the weights (vLLM's meaning; "
                            f"default: {GPU_MEMORY_UTILIZATION} on GPUs; --kv-blocks/--kv-memory override)")


def add_workload_flags(parser: argparse.ArgumentParser, for_search: bool = False) -> None:
    """`--serve` and what it serves (spec/workload.py): lengths or a trace, arrivals, latency targets; and the
    serving layout flags (the degrees --tp --pp --ep are the layout flags this parser already has)."""
    group = parser.add_argument_group("serving workload (with --serve)")
    group.add_argument("--serve", action="store_true", help="plan/estimate/simulate serving instead of training")
    group.add_argument("--prompt-len", default="512", help="prompt tokens: a number or mean:std (lognormal) "
                       "(default: 512)")
    group.add_argument("--output-len", default="128", help="output tokens: a number or mean:std (default: 128)")
    group.add_argument("--trace", default=None, metavar="FILE",
                       help="CSV or JSONL of requests with arrival_s, prompt_tokens, output_tokens")
    group.add_argument("--rate", default=None, help="requests/s over the deployment (Poisson), or inf (all at once)")
    group.add_argument("--batch", type=int, default=None, help="or: this many requests always in flight")
    group.add_argument("--requests", type=int, default=1000, help="requests in the stream (default: 1000)")
    group.add_argument("--ttft-slo", type=float, default=None, metavar="S", help="p90 time to first token target")
    group.add_argument("--tpot-slo", type=float, default=None, metavar="S", help="p90 time per output token target")
    add_serve_layout_flags(parser, for_search=for_search, skip=("tp", "pp", "ep"))
