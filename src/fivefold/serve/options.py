"""The flags of `serve` and `generate` turned into checked values: the ServeLayout (spec/serve.py) for this model
and device, and the model flags. Every check runs before a worker starts."""

from __future__ import annotations

import argparse
import os

from fivefold.errors import SpecError, require
from fivefold.spec import ModelSpec
from fivefold.spec.serve import BatchLimits, ServeLayout, check_gpu_memory_utilization, kv_blocks_for_memory

RUNTIME_DTYPES = ("fp32", "bf16", "fp16")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--from-hf | --checkpoint, the device and the compute dtype (the layout flags come from flags.py)."""
    parser.add_argument("--from-hf", default=None, metavar="DIR",
                        help="a local Hugging Face Llama, Mixtral or Qwen3-MoE folder")
    parser.add_argument("--checkpoint", default=None, metavar="DIR", help="a fivefold checkpoint (or a root of them)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default: cpu")
    parser.add_argument("--dtype", choices=list(RUNTIME_DTYPES), default=None,
                        help="weights and compute (default: fp32 on cpu, bf16 on cuda)")
    parser.add_argument("--memory-window", type=int, default=0, metavar="K",
                        help="keep only K layers' weights resident per worker, reading the next ones from the "
                             "safetensors files in the background while the current ones compute (--from-hf; "
                             "default: 0, every weight resident)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="N",
                        help="machines for the torchrun line printed for layouts of several processes (default: 1)")
    parser.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)  # set by the torchrun line


def layout_from_serve_args(args: argparse.Namespace, model: ModelSpec) -> ServeLayout:
    """The ServeLayout the flags describe, checked against the model and this machine."""
    dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    kv_dtype = args.kv_dtype or dtype
    require(kv_dtype in RUNTIME_DTYPES, "--kv-dtype", kv_dtype,
            f"the runtime keeps the KV cache in one of {', '.join(RUNTIME_DTYPES)}")
    defaults = BatchLimits()
    tp, pp = args.tp or 1, args.pp or 1
    if args.kv_blocks is not None and args.kv_memory is not None:
        raise SpecError("--kv-blocks/--kv-memory", f"{args.kv_blocks}/{args.kv_memory}", "give one of the two")
    kv_blocks = args.kv_blocks if args.kv_blocks is not None else defaults.kv_blocks
    if args.kv_memory is not None:
        require(args.kv_memory > 0, "--kv-memory", args.kv_memory, "must be a positive number of GiB")
        kv_blocks = kv_blocks_for_memory(args.kv_memory * 2**30, model, tp, pp, kv_dtype, defaults.block_size)
    limits = BatchLimits(max_batch=args.max_batch if args.max_batch is not None else defaults.max_batch,
                         max_tokens_per_step=(args.max_tokens_per_step if args.max_tokens_per_step is not None
                                              else defaults.max_tokens_per_step),
                         kv_blocks=kv_blocks)
    layout = ServeLayout(tp=tp, pp=pp, replicas=args.replicas or 1, ep=args.ep or 1, dtype=dtype,
                         kv_dtype=kv_dtype, limits=limits)
    layout.check_model(model)
    if args.gpu_memory_utilization is not None:
        check_gpu_memory_utilization(args.gpu_memory_utilization)
    require(args.memory_window >= 0, "--memory-window", args.memory_window, "must be 0 (off) or a number of layers")
    require(not args.memory_window or args.from_hf, "--memory-window", args.memory_window,
            "reads layers from a Hugging Face folder's safetensors files; give --from-hf (fivefold convert --to-hf "
            "turns a checkpoint into one)")
    require(model.sliding_window == 0, "model.sliding_window", model.sliding_window,
            "sliding-window attention is not built by fivefold's models")
    nnodes = getattr(args, "nnodes", 1)
    require(nnodes >= 1 and layout.devices % nnodes == 0, "--nnodes", nnodes,
            f"must divide the layout's {layout.devices} processes (tp x pp x replicas) into equal nodes")
    # Under torchrun this machine runs its own share of the ranks (LOCAL_WORLD_SIZE); else all of them.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", layout.devices)) if args.torchrun_worker else layout.devices
    if args.device == "cpu":
        from fivefold.runtime.launch import check_local_workers

        check_local_workers(local, "--tp x --pp x --replicas")
    else:
        from fivefold.runtime.launch import resolve_device

        _, gpus = resolve_device("cuda")
        require(gpus >= local, "--device", "cuda", f"{'this node runs' if args.torchrun_worker else 'the layout needs'} "
                f"{local} GPUs (tp x pp x replicas), this machine has {gpus}")
    return layout


def check_sampling(temperature: float, top_p: float, field_prefix: str = "--") -> None:
    require(temperature >= 0, f"{field_prefix}temperature", temperature, "must be 0 (greedy) or more")
    require(0 < top_p <= 1, f"{field_prefix}top-p" if field_prefix == "--" else "top_p", top_p,
            "must be in (0, 1]")
