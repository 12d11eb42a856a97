"""`fivefold train`: parsing and printing only; the work lives in runtime/ (prepare.py settles a run before
its workers start, launch.py starts them, slurm.py writes the cluster job) and jobfile.py (job files)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from fivefold.flags import REPLAN_KEEPS, plan_from_args, vocab_fixed_by
from fivefold.jobfile import keep_job_file


def cmd_train(args: argparse.Namespace, print_json: Callable[[Any], None]) -> int:
    """`fivefold train`: check everything, then train here, print the job for several machines or for Slurm."""
    from fivefold.checkpoint.resume import plan_for_hf
    from fivefold.planner import Choices
    from fivefold.runtime import RunConfig, launch, torchrun_command
    from fivefold.runtime.launch import WorkerFailed, check_launch_flags, nodes_of, run_torchrun_worker
    from fivefold.runtime.prepare import done_lines, fit_vocab_to_tokenizer, prepare_run, tokenizer_of_run
    from fivefold.runtime.slurm import print_slurm_script
    from fivefold.spec.job import check_slurm_flags

    # Everything that can be wrong with the plan, the flags or the data fails here, before any process starts.
    config = RunConfig.from_flags(vars(args), progress_to_stderr=args.json)
    plan = plan_from_args(args)
    config.validate()
    check_launch_flags(args.max_restarts)
    check_slurm_flags(args.time, args.partition, args.account, args.output, args.slurm)
    info = sys.stderr if args.json else sys.stdout
    if args.init_from_hf:  # the folder's config.json decides the model, its tokenizer reads the text
        plan = plan_for_hf(plan, args.init_from_hf, bool(args.plan), bool(args.layers_per_stage))
    config = tokenizer_of_run(config)
    plan = fit_vocab_to_tokenizer(plan, config.tokenizer, vocab_fixed_by(args),
                                  say=lambda line: print(line, file=sys.stderr if args.slurm else info, flush=True))
    if args.slurm:  # the job for the cluster's scheduler, instead of training here
        keep_job_file(args, None, sys.stderr)  # --dump-config: the job file, its [slurm] section included
        return print_slurm_script(plan, config, args)
    # A re-plan for another world size keeps what the user fixed (with --plan: what the file says).
    fixed = None if args.plan else Choices(**{k: getattr(args, k) for k in REPLAN_KEEPS})
    run = prepare_run(plan, config, nproc=args.nproc, plan_file=args.plan, torchrun_worker=args.torchrun_worker,
                      fixed=fixed, say=lambda line: print(line, file=info, flush=True),
                      warn=lambda line: print(f"warning: {line}", file=sys.stderr))
    keep_job_file(args, run.config.run_dir if run.torchrun_rank is None else None, info)  # fivefold/jobfile.py
    if run.torchrun_rank is not None:
        summary = run_torchrun_worker(run.config)
        if summary and args.json:
            print_json(summary)
        return 0
    command = torchrun_command(run.plan_file or "PLAN.toml", run.worker_flags, *nodes_of(run.plan),
                               max_restarts=args.max_restarts)
    print(f"on several machines, run on each: {command}", file=info, flush=True)
    try:
        summary = launch([run.config], run.nproc, max_restarts=args.max_restarts)[0]
    except WorkerFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_json(summary)
        return 0
    for line in done_lines(summary, run.config):
        print(line)
    return 0
