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
    if config.resume and world != plan.world_size:  # shrinking or growing: a plan for the new world size
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
    resume_from = resume_checkpoint(plan, config.checkpoint_dir, config.resume, config.seed, config.steps, warn=warn,
                                    optimizer=config.optimizer_record())
    if resume_from is not None:
        check_same_data(resume_from, data, plan, config)
    for opened in (data, eval_data):  # only now: a refused command writes nothing
        if opened is not None:
            write_data_caches(opened)
    run_dir, plan_file = prepare_run_dir(plan, config, plan_file, is_rank0)
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


def check_same_data(checkpoint: Path, data: Any, plan: Plan, config: RunConfig) -> None:
    """The resumed run's data (sources, blend weights) is the checkpoint's: its saved loader position only means
    something in the same data. Checked here, so a mismatch is one line before any worker starts."""
    from fivefold.checkpoint.layout import read_checkpoint_info
    from fivefold.data import GlobalBatchLoader
    from fivefold.errors import SpecError

    saved = read_checkpoint_info(checkpoint)["extra"]["train_state"]["loader"]
    loader = GlobalBatchLoader(data, plan.train.seq_len, plan.train.global_batch, config.seed)
    key = loader.differs_from(saved)
    if key is not None:
        raise SpecError("--data", config.data or "builtin", f"the checkpoint's data had {key}="
                                                          f"{saved.get(key)}, this data has {key}="
                                                          f"{loader.state_dict().get(key)}; resume with the same "
                                                          "data (and blend weights)")


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
