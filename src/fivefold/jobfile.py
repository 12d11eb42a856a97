"""The job file of `fivefold train --config job.toml`: every `train` flag, grouped in sections.

    [model]      model, init_from_hf, expert_imbalance
    [cluster]    cluster, nproc, device
    [layout]     plan, dp, tp, pp, cp, ep, cp_method, micro_batch, schedule, virtual_stages, layers_per_stage,
                 recompute, sequence_parallel, zero, vocab_parallel
    [data]       data, text_field, tokenizer, seq_len, global_batch, document_mask, eval_data, eval_every,
                 eval_batches
    [optimizer]  lr, warmup_steps, lr_schedule, min_lr, decay_steps, weight_decay, betas, eps, grad_clip
    [run]        every other `train` flag (steps, seed, dtype, metrics_file, checkpoint_dir, ...)
    [slurm]      time, partition, account, output (what --slurm passes to sbatch)

A key is the flag's name without the dashes, `-` written `_` (`--warmup-steps` -> warmup_steps). The file sets
the flags' defaults, so flags given on the command line win. Paths in the file are read from the file's folder
(and --dump-config writes them as seen from its file's folder), so a job file travels with its data. Each value
is checked against its flag (kind, choices, the flag's own parser) and an unknown section or key is one line
naming it. `--dump-config FILE` writes the effective job (every flag's value, after the command line) in this
form. argparse reads the flags; tomllib and tomli_w the file; no torch import.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fivefold.errors import SpecError
from fivefold.flags import add_slurm_flags

SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("model", "init_from_hf", "expert_imbalance"),
    "cluster": ("cluster", "nproc", "device"),
    "layout": ("plan", "dp", "tp", "pp", "cp", "ep", "cp_method", "micro_batch", "schedule", "virtual_stages",
               "layers_per_stage", "recompute", "sequence_parallel", "zero", "vocab_parallel"),
    "data": ("data", "text_field", "data_change", "tokenizer", "seq_len", "global_batch", "document_mask",
             "eval_data", "eval_every", "eval_batches"),
    "optimizer": ("lr", "warmup_steps", "lr_schedule", "min_lr", "decay_steps", "weight_decay", "betas", "eps",
                  "grad_clip"),
}
RUN_SECTION = "run"  # every train flag no other section names
SLURM_SECTION = "slurm"  # what --slurm passes to sbatch
SLURM_KEYS = ("time", "partition", "account", "output")
NOT_IN_JOB = frozenset({"help", "json", "torchrun_worker", "config", "dump_config", "slurm"})
# Keys holding paths, read from the job file's folder (a blend's paths one by one); model and cluster only
# when they name a file (else they are a preset, an inline spec or NODESxGPUSxDEVICE).
PATH_KEYS = ("plan", "init_from_hf", "data", "eval_data", "tokenizer", "metrics_file", "tensorboard",
             "checkpoint_dir", "output")
FILE_OR_NAME_KEYS = ("model", "cluster")


def job_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The flags a job file may set, by key (argparse dest)."""
    return {action.dest: action for action in parser._actions
            if action.dest not in NOT_IN_JOB and action.option_strings}


def section_of(key: str) -> str:
    if key in SLURM_KEYS:
        return SLURM_SECTION
    return next((name for name, keys in SECTIONS.items() if key in keys), RUN_SECTION)


def all_sections() -> list[str]:
    return [*SECTIONS, RUN_SECTION, SLURM_SECTION]


def check_value(action: argparse.Action, value: Any, where: str) -> Any:
    """The file's value for `action`'s flag in the kind argparse would give it, or one SpecError line."""
    flag = action.option_strings[0]
    boolean = action.type is None and action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction)
    if boolean:
        if not isinstance(value, bool):
            raise SpecError(where, value, f"{flag} is a switch: write true or false")
        return value
    if action.nargs == "?" and action.const is True and isinstance(value, bool):  # a switch with an optional value
        return value
    if callable(action.type) and action.type not in (int, float, str):  # the flag's own parser (spec/job.py)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise SpecError(where, value, f"{flag} takes a value such as {action.metavar or 'VALUE'}")
        try:
            return action.type(str(value))
        except SpecError as exc:
            raise SpecError(where, value, exc.fix) from None
    if action.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(where, value, f"{flag} takes an integer")
    elif action.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(where, value, f"{flag} takes a number")
        value = float(value)
    elif not isinstance(value, str):
        raise SpecError(where, value, f"{flag} takes a string, e.g. \"{action.default or 'VALUE'}\"")
    if action.choices is not None and value not in action.choices:
        raise SpecError(where, value, f"use one of {', '.join(str(c) for c in action.choices)}")
    return value


def read_job_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """{flag key: value} from a job file, every section, key and value checked against `parser`'s flags."""
    from fivefold.spec.units import read_toml_file

    document = read_toml_file(path, "--config")
    flags = job_flags(parser)
    values: dict[str, Any] = {}
    sections = all_sections()
    for name, table in document.items():
        if not isinstance(table, dict):
            key = name.replace("-", "_")
            where = f"{path}:{name}"
            if key in flags:
                raise SpecError(where, table, f"a key outside any section; put it in [{section_of(key)}]")
            raise SpecError(where, table, f"not a section; a job file has sections {', '.join(sections)}")
        if name not in sections:
            raise SpecError(f"{path}:section", name, f"unknown section; a job file has {', '.join(sections)}")
        for raw_key, value in table.items():
            key = raw_key.replace("-", "_")
            where = f"{path}:[{name}].{raw_key}"
            if key not in flags:
                known = [k for k in flags if section_of(k) == name]
                raise SpecError(where, value, f"unknown key in [{name}]; it takes {', '.join(known)}")
            if section_of(key) != name:
                raise SpecError(where, value, f"belongs in the [{section_of(key)}] section")
            values[key] = check_value(flags[key], value, where)
    return relative_to(values, Path(path).parent, into_file=True)


def relative_to(values: dict[str, Any], folder: Path, into_file: bool) -> dict[str, Any]:
    """The path values of a job, moved between the current folder and a job file's `folder`: read from the
    file (into_file=True: 'web/' in jobs/job.toml is jobs/web/) or written into it (False: the path as seen
    from the file's folder). Absolute paths stay as they are."""
    import os

    from fivefold.spec.datasource import map_data_paths

    def move(path: str) -> str:
        if os.path.isabs(path):
            return path
        trailing = "/" if path.endswith("/") else ""
        moved = os.path.normpath(folder / path) if into_file else os.path.relpath(path, folder)
        return moved + trailing if not moved.endswith("/") else moved

    moved = dict(values)
    for key, value in values.items():
        if not isinstance(value, str):
            continue
        if key in ("data", "eval_data"):
            moved[key] = map_data_paths(value, move)
        elif key in PATH_KEYS or (key in FILE_OR_NAME_KEYS and (value.endswith(".toml") or
                                                                  (folder / value if into_file else Path(value))
                                                                  .is_file())):
            moved[key] = move(value)
    return moved


def job_file_text(args: argparse.Namespace, parser: argparse.ArgumentParser, folder: Path | None = None) -> str:
    """The effective job of parsed `train` arguments as a job file (flags left unset are left out), its paths as
    seen from `folder`, the folder the file goes to (None: as given)."""
    import tomli_w

    document: dict[str, dict[str, Any]] = {name: {} for name in all_sections()}
    values = {key: getattr(args, key, None) for key in job_flags(parser)}
    if folder is not None:
        values = relative_to({k: v for k, v in values.items() if v is not None}, folder, into_file=False)
    for key, value in values.items():
        if value is not None:
            document[section_of(key)][key] = value
    header = "# fivefold train --config FILE: the effective job of a run (flags given with --config win)\n"
    return header + tomli_w.dumps({name: table for name, table in document.items() if table})


def add_job_flags(parser: argparse.ArgumentParser) -> None:
    """`train`'s --config, --dump-config and --slurm (what to do with the job rather than how it trains)."""
    parser.add_argument("--config", default=None, metavar="JOB.toml", help="a job file of train flags in sections "
                        "(docs/data.md); flags on the command line win")
    parser.add_argument("--dump-config", default=None, metavar="FILE", help="write the effective job file of this "
                        "run here (the run goes on)")
    parser.add_argument("--slurm", action="store_true", help="print an sbatch script for the plan (one torchrun "
                        "agent per node, rendezvous from SLURM's variables, requeued after a preemption or the time "
                        "limit) and exit without training")
    add_slurm_flags(parser)
    parser.set_defaults(job_parser=parser)


def parse_with_job_file(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line; with --config, parsed again over the job file's values (the command line wins).
    A --dump-config path is checked here, before anything runs."""
    from fivefold.outputs import check_output_file

    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        args.job_parser.set_defaults(**read_job_file(args.config, args.job_parser))
        args = parser.parse_args(argv)
    if getattr(args, "dump_config", None):
        check_output_file(args.dump_config, "--dump-config", "job.toml")
    return args


def keep_job_file(args: argparse.Namespace, run_dir: str | None, info: Any) -> None:
    """--dump-config FILE, and the run folder's job.toml: the effective job of this run (after every check)."""
    if not (args.dump_config or run_dir):
        return
    if args.dump_config:
        text = job_file_text(args, args.job_parser, Path(args.dump_config).parent)
        print(f"wrote the job file {write_job_file(text, args.dump_config)}", file=info, flush=True)
    if run_dir:
        write_job_file(job_file_text(args, args.job_parser, Path(run_dir)), Path(run_dir) / "job.toml")


def write_job_file(text: str, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
