"""What `fivefold train` settles before any worker starts, and the line it prints when the run is done.

`prepare_run` takes a checked RunConfig and the plan the flags describe, and returns everything the launch
needs: the plan for this world size (re-planned when a resume runs on another number of processes), the
checks of the runtime and the data, the checkpoint to resume from, the run folder, and the worker line.
Every problem is a SpecError here, so a bad run stops before a process starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from fivefold.data import write_data_caches
from fivefold.elastic.events import restart_count
from fivefold.errors import require
from fivefold.runtime.config import RunConfig
from fivefold.runtime.expert_parallel import balance_warning
from fivefold.runtime.launch import check_data, check_runnable, prepare_run_dir, resolve_device, torchrun_world
from fivefold.spec import Plan

if TYPE_CHECKING:
    from fivefold.planner import Choices


@dataclass
class PreparedRun:
    plan: Plan  # the plan the workers run (re-planned for the world size when resuming on another one)
    config: RunConfig  # complete: plan text, device, run folder, checkpoint to resume from
    nproc: int  # processes in the whole world
    worker_flags: list[str]  # the run's flags, for the torchrun line of several machines
    plan_file: str | None  # the plan file that line names (None: no file was written or given)
    torchrun_rank: int | None  # under torchrun: this process's global rank; None: the local launcher


def prepare_run(plan: Plan, config: RunConfig, *, nproc: int | None, plan_file: str | None,
                torchrun_worker: bool, fixed: Choices | None, say: Callable[[str], None],
                warn: Callable[[str], None]) -> PreparedRun:
    """Settle the run of `plan` under `config` (already validated). `nproc` is --nproc (None: the plan's world
    size), `fixed` the layout flags a re-plan keeps, `say` gets the re-plan line and `warn` one line per
    checkpoint skipped on the way to the one resumed from."""
    from fivefold.checkpoint.resume import resume_checkpoint

    device, gpus = resolve_device(config.device)
    # Under torchrun (several machines) this process is one worker: torchrun started the world.
    worker_world = torchrun_world() if torchrun_worker else None
    local_nproc = worker_world[1] if worker_world else None
    is_rank0 = worker_world is None or worker_world[2] == 0
    world = worker_world[0] if worker_world else nproc if nproc is not None else plan.world_size
    # torchrun restarted this worker group after a failure: the run goes on from its newest checkpoint.
    continuing = bool(config.resume) or (torchrun_worker and restart_count() > 0)
    resume = resumes(config, continuing)
    if resume and world != plan.world_size:  # shrinking or growing: a plan for the new world size
        from fivefold.elastic.replan import replan_for_world

        plan, line = replan_for_world(plan, world, fixed,
                                      lambda p: check_runnable(p, world, device, gpus, local_nproc))
        if is_rank0:
            say(line)
    check_runnable(plan, world, device, gpus, local_nproc)
    check_precision_flags(plan, config, device)
    if is_rank0 and (line := balance_warning(plan.model)):
        warn(line)
    config.diloco(plan)  # --dp-sync diloco against this plan: the outer groups must split its dp
    if plan.vocab_parallel:
        require(config.dp_sync == "sync", "--vocab-parallel", True, "runs with --dp-sync sync only")
    data = check_data(plan, config.data, config.tokenizer, config.text_field)
    eval_data = check_data(plan, config.eval_data, config.tokenizer, config.text_field, "--eval-data") \
        if config.eval_data else None
    resume_from = resume_checkpoint(plan, config.checkpoint_dir, resume, config.seed, config.steps, warn=warn,
                                    optimizer=config.optimizer_record())
    if resume_from is not None:
        changed = check_same_data(resume_from, data, plan, config)
        if changed and is_rank0:
            say(changed)
    if config.metrics_file and not continuing and not config.overwrite:
        refuse_other_run(config.metrics_file)
    for opened in (data, eval_data):  # only now: a refused command writes nothing
        if opened is not None:
            write_data_caches(opened)
    if config.overwrite and is_rank0:
        clear_run_outputs(config)
    run_dir, plan_file = prepare_run_dir(plan, config, plan_file, is_rank0, fresh=not continuing)
    if torchrun_worker and is_rank0 and restart_count() == 0 and run_dir:  # the local launcher writes its own
        from fivefold.elastic.events import LAUNCHER, EventLog
        from fivefold.runtime.launch import slurm_job

        EventLog(run_dir, restart=LAUNCHER).write("launch", nproc=world, torchrun=True, **slurm_job())
    worker_flags = config.to_flags()
    config = dataclasses.replace(config, plan_toml=plan.to_toml(), device=device, run_dir=run_dir,
                                 resume_from=str(resume_from) if resume_from else None)
    return PreparedRun(plan, config, world, worker_flags, plan_file, worker_world[2] if worker_world else None)


def check_precision_flags(plan: Plan, config: RunConfig, device: str) -> None:
    """--fp8-recipe and --expert-gemm against the plan and this machine (runtime/float8.py, models/moe.py)."""
    require(config.fp8_recipe is None or plan.train.dtype == "fp8", "--fp8-recipe", config.fp8_recipe,
            f"scales FP8 GEMMs: it needs --dtype fp8 (the plan trains in {plan.train.dtype})")
    if config.expert_gemm != "auto":
        from fivefold.runtime.expert_parallel import check_expert_gemm

        check_expert_gemm(plan, config.expert_gemm, device)


VOCAB_MULTIPLE = 128  # a tokenizer's size is rounded up to this (Megatron-LM's default padding; GEMM-friendly)


def tokenizer_of_run(config: RunConfig) -> RunConfig:
    """The run's tokenizer: --tokenizer, else the --init-from-hf folder's tokenizer.json (its text is read the
    way the model was trained), else bytes."""
    from fivefold.checkpoint.tokenizer_files import folder_tokenizer

    found = folder_tokenizer(config.init_from_hf) if config.tokenizer is None else None
    return dataclasses.replace(config, tokenizer=found) if found else config


def fit_vocab_to_tokenizer(plan: Plan, tokenizer: str | None, fixed_by: str | None,
                           say: Callable[[str], None]) -> Plan:
    """With --tokenizer: the model's vocab becomes the tokenizer's size rounded up to a multiple of
    VOCAB_MULTIPLE, unless something fixed it (`fixed_by`, flags.vocab_fixed_by), which must then hold every
    token id."""
    from fivefold.data import load_tokenizer
    from fivefold.errors import SpecError

    if tokenizer is None:
        return plan
    size = load_tokenizer(tokenizer).vocab_size
    padded = -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    vocab = plan.model.vocab
    if fixed_by is None:
        if padded != vocab:
            say(f"model vocab {vocab} -> {padded}: the tokenizer's {size} tokens rounded up to a multiple of "
                f"{VOCAB_MULTIPLE} (give vocab in --model to fix it)")
            plan = plan.replace(model=dataclasses.replace(plan.model, vocab=padded))
        return plan
    if size > vocab:
        fixes = (("the plan file", f"write vocab = {padded} in its [model] table, or leave out --plan and give the "
                                   "layout as flags"),
                 ("the Hugging Face", "use the folder's own tokenizer (leave out --tokenizer) or one of at most "
                                      "that many tokens"),
                 ("--model ", f"write vocab = {padded} (or more) in that file, or leave vocab out and the tokenizer "
                              "sets it"),
                 ("--model", f"give vocab={padded} (or more) in --model, or leave vocab out and the tokenizer sets "
                             "it"))
        fix = next(text for prefix, text in fixes if fixed_by.startswith(prefix))
        raise SpecError("--tokenizer", tokenizer, f"has {size} tokens but model.vocab={vocab}, fixed by {fixed_by}; "
                                                  f"{fix}")
    return plan


def resumes(config: RunConfig, continuing: bool) -> bool:
    """Whether this launch resumes from a checkpoint: --resume (one must exist), --resume auto or a torchrun
    restart when one exists."""
    from fivefold.elastic.restart import newest_complete

    if config.resume is True:
        return True
    return continuing and newest_complete(config.checkpoint_dir) is not None


def check_same_data(checkpoint: Path, data: Any, plan: Plan, config: RunConfig) -> str | None:
    """The resumed run's data (sources, blend weights) is the checkpoint's: its saved loader position only means
    something in the same data. Checked here, so a mismatch is one line before any worker starts; with
    --data-change allow, the line that says which positions restart (None when nothing changed)."""
    from fivefold.checkpoint.layout import read_checkpoint_info
    from fivefold.data import GlobalBatchLoader
    from fivefold.errors import SpecError

    saved = read_checkpoint_info(checkpoint)["extra"]["train_state"]["loader"]
    loader = GlobalBatchLoader(data, plan.train.seq_len, plan.train.global_batch, config.seed)
    key = loader.differs_from(saved)
    if key is None:
        return None
    if config.data_change == "allow" and key not in ("seed", "seq_len"):
        return loader.describe_change(saved)
    raise SpecError("--data", config.data or "builtin", f"the checkpoint's data had {key}="
                                                      f"{saved.get(key)}, this data has {key}="
                                                      f"{loader.state_dict().get(key)}; resume with the same "
                                                      "data (and blend weights), or add --data-change allow")


def refuse_other_run(metrics_file: str) -> None:
    """A new run does not append to the metrics file of another: --resume continues it, --overwrite replaces it."""
    from fivefold.errors import SpecError
    from fivefold.report.load import recorded_steps

    steps = recorded_steps(Path(metrics_file))
    if steps:
        raise SpecError("--metrics-file", metrics_file, f"holds steps {min(steps)}-{max(steps)} of another run; add "
                                                        "--resume to continue it (with its --checkpoint-dir), "
                                                        "--overwrite to replace it, or give a new file")


def clear_run_outputs(config: RunConfig) -> None:
    """--overwrite: the metrics file and what the run folder holds of the run that wrote it."""
    import shutil

    from fivefold.report.load import RUN_OUTPUTS

    if not config.metrics_file:
        return
    metrics = Path(config.metrics_file)
    metrics.unlink(missing_ok=True)
    for name in RUN_OUTPUTS:
        path = metrics.parent / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def done_lines(summary: dict, config: RunConfig) -> list[str]:
    """What the launcher prints after a run: the recovery report (when workers failed) and one `done:` line."""
    lines = []
    if "recovery" in summary:
        from fivefold.elastic.report import render_report

        lines += render_report(summary["recovery"])
    saves = ""
    if config.checkpoint_dir:
        blocked = summary["checkpoint_seconds"]["blocked"]  # per save: how long training waited for it
        saves = (f"; checkpoints in {config.checkpoint_dir} (training waited {sum(blocked):.2f} s for "
                 f"{len(blocked)} save(s))")
    lines.append(f"done: {summary['steps']} steps of {summary['plan']}, final loss {summary['final_loss']:.4f}, "
                 f"{summary['tokens_per_s']:,.0f} tok/s, mfu {100 * summary['mfu']:.2f}%, "
                 f"peak memory {summary['peak_memory_gib']:.2f} GiB"
                 + (f"; metrics in {config.metrics_file}" if config.metrics_file else "") + saves)
    return lines
