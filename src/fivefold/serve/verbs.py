"""The `generate` and `serve` verbs of the `fivefold` command: their flags and handlers (parsing and printing
only; imports nothing heavy until a verb runs, so `fivefold --help` stays fast)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any


def add_serve_verbs(verb: Callable[..., argparse.ArgumentParser], add_json_flag: Callable[[Any], None],
                    print_json: Callable[[Any], None]) -> None:
    """Register both verbs with cli.py's `verb(name, help, handler)`."""
    from fivefold.flags import add_serve_layout_flags
    from fivefold.serve.options import add_model_flags

    parsers: dict[str, argparse.ArgumentParser] = {}

    def cmd_generate(args: argparse.Namespace) -> int:
        from fivefold.serve.generate import run_generate
        from fivefold.serve.workers import WorkerDied

        args.worker_flags = repeated_flags(parsers["generate"], args)
        try:
            summary = run_generate(args)
        except WorkerDied as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if summary is None:  # a torchrun worker rank other than 0: rank 0 wrote the output
            return 0
        if args.json:
            print_json(summary)
        else:
            print(f"wrote {summary['requests']} completions ({summary['completion_tokens']} tokens, "
                  f"{summary['tokens_per_s']:,.1f} tokens/s) to {summary['output']}")
        return 0

    def cmd_serve(args: argparse.Namespace) -> int:
        from fivefold.serve.server import run_server

        args.worker_flags = repeated_flags(parsers["serve"], args)
        return run_server(args)

    p = verb("generate", "complete every prompt of a JSON-lines file (continuous batching over tp x pp x replicas)",
             cmd_generate)
    add_model_flags(p)
    add_serve_layout_flags(p)
    p.add_argument("--input", default=None, help="JSON lines, each {\"prompt\": text} or {\"prompt_ids\": [...]}")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="instead of --input: a request trace (CSV or JSONL: arrival_s, prompt_tokens, output_tokens, "
                        "as `estimate --serve --trace`); random prompts of those lengths arrive at those times and "
                        "generate exactly output_tokens each")
    add_record_flags(p)
    p.add_argument("--output", required=True, help="JSON lines: completion_ids, text, finish_reason, timings")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt at most (default: 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; a token depends on (seed, line, position)")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens even past an end token")
    add_json_flag(p)
    parsers["generate"] = p

    p = verb("serve", "an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)", cmd_serve)
    add_model_flags(p)
    add_serve_layout_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="requests waiting for a slot before new ones get HTTP 429 (default: 1024)")
    add_record_flags(p)
    parsers["serve"] = p


def add_record_flags(parser: argparse.ArgumentParser) -> None:
    """--metrics-file and --cluster, the same in `generate` and `serve` (serve/record.py writes the run)."""
    parser.add_argument("--metrics-file", default=None, metavar="RUN/requests.jsonl",
                        help="record the run for `fivefold report RUN`: per-request and per-step timings, the layout "
                             "and the cluster; the report compares them with the cost model's and the simulator's "
                             "prediction for the same requests (serve: every request as it finishes)")
    parser.add_argument("--cluster", default=None, metavar="FILE",
                        help="with --metrics-file: the cluster the prediction is made for (a `fivefold profile` "
                             "file; default: the catalog's cpu or GPU)")


def repeated_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The flags given (those not at their default), as the torchrun line repeats them for every rank."""
    flags = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "nnodes", "torchrun_worker"):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flags += [action.option_strings[0]] if action.nargs == 0 else [action.option_strings[0], str(value)]
    return flags
