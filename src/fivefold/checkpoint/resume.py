"""What `fivefold train` checks about checkpoints before any worker starts, and how a resume is described.

A training checkpoint (runtime/checkpointing.py writes it) is a step folder of layout.py whose
fivefold.json carries the run's `train_state`: the step, the loader position (samples_seen, counted in
sequences over the whole run, so independent of the plan) and the learning-rate schedule. Everything
here reads only JSON and DCP metadata, never a tensor; a refused resume leaves the checkpoint directory
exactly as it was, and an accepted one only renames corrupted newer checkpoints (step-XXXXXXXX.corrupt).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from fivefold.checkpoint.layout import (INFO_FILE, STEP_RE, CheckpointWarning, newest_checkpoint, read_checkpoint_info,
                                        set_aside_corrupted)
from fivefold.errors import SpecError, require
from fivefold.spec import ModelSpec, Plan

TRAIN_STATE = "train_state"  # key of the run's state in fivefold.json "extra"
# Plan fields whose change a resume reports (all of them may change: weights and optimizer reshard).
LAYOUT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "etp", "zero", "micro_batch", "schedule", "virtual_stages",
                 "layers_per_stage", "recompute", "sequence_parallel")


def architecture_difference(expected: ModelSpec, found: ModelSpec) -> str | None:
    """The first field (other than the name) in which two model specs differ, or None."""
    for field in dataclasses.fields(ModelSpec):
        if field.name != "name" and getattr(expected, field.name) != getattr(found, field.name):
            return field.name
    return None


def check_checkpoint_flags(checkpoint_dir: str | None, every: int, keep: int, resume: bool) -> None:
    """The --checkpoint-dir / --checkpoint-every / --keep / --resume combination makes sense."""
    require(every >= 0, "--checkpoint-every", every, "must be 0 (save only at the end) or a positive step count")
    require(keep >= 1, "--keep", keep, "must keep at least 1 checkpoint")
    require(checkpoint_dir is not None or not every, "--checkpoint-every", every, "needs --checkpoint-dir DIR")
    require(checkpoint_dir is not None or not resume, "--resume", True,
            "needs --checkpoint-dir DIR (the folder of step-XXXXXXXX checkpoints to continue from)")
    if checkpoint_dir is not None:
        root = Path(checkpoint_dir)
        require(not root.exists() or root.is_dir(), "--checkpoint-dir", checkpoint_dir, "is a file; give a folder")


def find_resume_checkpoint(checkpoint_dir: str | Path) -> tuple[Path, list[str]]:
    """The newest complete, verified checkpoint under `checkpoint_dir`, and one line per folder skipped
    on the way (incomplete or corrupted, newest first). Raises SpecError naming them when none is usable."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        newest = newest_checkpoint(checkpoint_dir)
    skipped = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    if newest is None:
        why = f"; {'; '.join(skipped)}" if skipped else " (no step-XXXXXXXX folder)"
        raise SpecError("--resume", str(checkpoint_dir), f"no complete checkpoint to resume from{why}")
    return newest, skipped


def refuse_existing_checkpoints(checkpoint_dir: str | None) -> None:
    """A new run (no --resume) must not write into a folder of another run's checkpoints."""
    if checkpoint_dir is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        newest = newest_checkpoint(checkpoint_dir, verify_hashes=False)
    if newest is not None:
        raise SpecError("--checkpoint-dir", checkpoint_dir, f"already holds checkpoints (newest {newest.name}); "
                                                           "add --resume to continue that run, or choose a new folder")


def check_resumable(path: Path, plan: Plan, seed: int, steps: int, optimizer: dict | None = None) -> dict:
    """fivefold.json of `path` (read_checkpoint_info) after checking that this run can continue from it:
    a training checkpoint, the same model, the same data order, the same optimizer settings (`optimizer`:
    RunConfig.optimizer_record), and steps left to run."""
    info = read_checkpoint_info(path)
    state = (info.get("extra") or {}).get(TRAIN_STATE)
    require(state is not None, "--resume", str(path),
            "holds weights only (no optimizer or data position; e.g. written by `fivefold convert`); "
            "resume needs a checkpoint written by `fivefold train`")
    field = architecture_difference(plan.model, info["model"])
    if field is not None:
        saved = getattr(info["model"], field)
        raise SpecError(f"{path / INFO_FILE}:model.{field}", saved,
                        f"the checkpoint holds model {info['model'].name} with {field}={saved!r}, this run's model "
                        f"has {field}={getattr(plan.model, field)!r}; resume with the same model, or use a new "
                        "--checkpoint-dir")
    loader = state["loader"]
    require(loader["seed"] == seed, "--seed", seed,
            f"the checkpoint's data order was drawn with seed {loader['seed']}; resume with --seed {loader['seed']}")
    require(loader["seq_len"] == plan.train.seq_len, "--seq-len", plan.train.seq_len,
            f"the checkpoint was trained with seq_len {loader['seq_len']}; resume with --seq-len {loader['seq_len']}")
    saved_optimizer = state.get("optimizer") or {}
    # Fields a checkpoint does not record (written before they existed) are not compared.
    field = next((name for name, value in (optimizer or {}).items()
                  if name in saved_optimizer and saved_optimizer[name] != value), None)
    if field is not None:
        def shown(value):
            if isinstance(value, list):
                return ",".join(f"{b:g}" if isinstance(b, (int, float)) else str(b) for b in value)
            return "the default" if value is None else value

        flag = "--" + field.replace("_", "-")
        raise SpecError(flag, shown((optimizer or {})[field]), f"the checkpoint was trained with {field}="
                                                                f"{shown(saved_optimizer[field])}; resume with the "
                                                                f"same {flag}")
    require(steps > state["step"], "--steps", steps,
            f"the checkpoint is at step {state['step']}; give more steps than that to continue")
    return info


def plan_for_hf(plan: Plan, folder: str, model_from_plan_file: bool, keep_layers_per_stage: bool) -> Plan:
    """The plan with the Hugging Face folder's model: the folder's config.json decides the model, unless
    the plan came from a file, whose model must then be the same."""
    from fivefold.checkpoint.hf import CONFIG_FILE, _weight_files, read_hf_config

    require((Path(folder) / CONFIG_FILE).is_file(), "--init-from-hf", folder,
            f"no {CONFIG_FILE}; give a local Hugging Face Llama folder")
    _, spec = read_hf_config(Path(folder))
    try:
        _weight_files(Path(folder))  # the weights exist (else only a worker would find out)
    except SpecError as exc:
        raise SpecError("--init-from-hf", folder, exc.fix) from None
    if model_from_plan_file:
        field = architecture_difference(plan.model, spec)
        if field is not None:
            raise SpecError(f"{Path(folder) / CONFIG_FILE}: model.{field}", getattr(spec, field),
                            f"the plan's model has {field}={getattr(plan.model, field)!r}; use a plan of this model")
        return plan
    return plan.replace(model=spec, layers_per_stage=plan.layers_per_stage if keep_layers_per_stage else ())


def resume_checkpoint(plan: Plan, checkpoint_dir: str | None, resume: bool, seed: int, steps: int,
                      warn=print, optimizer: dict | None = None) -> Path | None:
    """The checkpoint this run continues from (None: a new run), after every check that can be made
    without a worker; `warn` gets one line per checkpoint folder skipped on the way."""
    if not resume:
        refuse_existing_checkpoints(checkpoint_dir)
        return None
    path, skipped = find_resume_checkpoint(checkpoint_dir)
    check_resumable(path, plan, seed, steps, optimizer)
    check_model_tensors(path, plan.model)
    # Only now, when the resume is sure to start, touch the folder: a corrupted newer checkpoint goes aside.
    moved = set_aside_corrupted(checkpoint_dir, newer_than=check_step(path))
    lines = [line for line in skipped if not any(str(old) in line for old, _, _ in moved)]
    lines += [f"checkpoint {old} is {problem}: moved it aside to {new.name} (kept, not deleted); resuming from "
              f"{path.name}" for old, new, problem in moved]
    for line in lines:
        warn(line)
    return path


def check_step(path: Path) -> int:
    """The step number of a step-XXXXXXXX folder."""
    match = STEP_RE.match(path.name)
    return int(match.group(1)) if match else 0


def check_model_tensors(path: Path, spec: ModelSpec) -> None:
    """Every weight of `spec` is in the checkpoint's DCP metadata with the same shape (reads .metadata only)."""
    from fivefold.checkpoint.layout import check_model_matches
    from fivefold.models import build_model

    check_model_matches(path, build_model(spec, device="meta").state_dict())


def plan_changes(saved_plan: dict | None, plan: Plan) -> list[str]:
    """'dp 2 -> 1'-style lines for every layout field (and the global batch) that differs from the saved plan."""
    if not saved_plan:
        return []
    now = plan.to_dict()
    saved_fields, now_fields = saved_plan.get("plan", {}), now["plan"]
    changes = []
    for name in LAYOUT_FIELDS:
        before, after = saved_fields.get(name), now_fields.get(name)
        if before is not None and before != after:
            changes.append(f"{name} {before} -> {after}")
    saved_batch = saved_plan.get("train", {}).get("global_batch")
    if saved_batch is not None and saved_batch != plan.train.global_batch:
        changes.append(f"global_batch {saved_batch} -> {plan.train.global_batch}")
    return changes


def describe_resume(path: Path, info: dict, plan: Plan, schedule: dict) -> str:
    """The line rank 0 logs: which checkpoint, saved under which plan, and what changed."""
    state = info["extra"][TRAIN_STATE]
    saved_plan = info.get("plan")
    saved = "an unknown plan"
    if saved_plan:
        fields = saved_plan["plan"]
        saved = f"dp{fields['dp']} tp{fields['tp']} pp{fields['pp']} zero{fields['zero']}"
        if fields["pp"] > 1:
            virtual = fields["virtual_stages"]
            saved += f" {fields['schedule']}" + (f"(v{virtual})" if virtual > 1 else "")
    changes = plan_changes(saved_plan, plan)
    saved_schedule = state.get("lr_schedule", {})
    schedule_changes = [f"{key} {saved_schedule[key]} -> {value}" for key, value in schedule.items()
                        if key in saved_schedule and saved_schedule[key] != value]
    text = (f"plan changed: {', '.join(changes)}: weights and optimizer state resharded" if changes
            else "same plan")
    if schedule_changes:
        text += f"; LR schedule changed: {', '.join(schedule_changes)}"
    elif not changes:
        text += ": exact continuation"
    return (f"resumed from {path} (step {state['step']}, saved under {saved}); {text}; "
            f"data continues at sample {state['loader']['samples_seen']}")
