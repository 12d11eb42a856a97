"""The on-disk layout of a fivefold checkpoint, and single-process save/load of a model.

    ROOT/step-00000120/
        .metadata, __0_0.distcp, ...   written by torch.distributed.checkpoint (DCP) from
                                       {"model": ..., ["optimizer": ..., "train_state": ...]}
        fivefold.json                  model spec, step, plan (if any), extra run facts
        manifest.json                  SHA-256 and size of every file above
        COMMIT                         written last: its presence means the checkpoint is whole

A directory without COMMIT, or whose files do not match the manifest, is skipped with a warning that
names it. Loading never writes into a checkpoint directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from fivefold.errors import SpecError
from fivefold.spec import ModelSpec
from fivefold.spec.checks import is_int
from fivefold.spec.jsonfields import Fields
from fivefold.spec.model import model_from_dict

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fivefold.spec import Plan

FORMAT = "fivefold-checkpoint"
FORMAT_VERSION = 1
INFO_FILE = "fivefold.json"
MANIFEST_FILE = "manifest.json"
COMMIT_FILE = "COMMIT"
STEP_RE = re.compile(r"^step-(\d{8})$")


class CheckpointWarning(UserWarning):
    """A checkpoint directory was skipped (incomplete or corrupted)."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _payload_files(path: Path) -> list[Path]:
    skip = {MANIFEST_FILE, COMMIT_FILE}
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name not in skip)


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def finalize_checkpoint(path: str | Path, spec: ModelSpec, step: int, plan: Plan | None = None,
                        extra: dict | None = None) -> None:
    """After DCP has written its files: fivefold.json, then manifest.json, then COMMIT (one process only)."""
    path = Path(path)
    info = {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "model": spec.to_dict(),
            "plan": plan.to_dict() if plan is not None else None, "extra": extra or {},
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write_atomic(path / INFO_FILE, json.dumps(info, indent=2, default=str))
    files = {str(p.relative_to(path)): {"sha256": _sha256(p), "bytes": p.stat().st_size}
             for p in _payload_files(path)}
    _write_atomic(path / MANIFEST_FILE, json.dumps({"version": FORMAT_VERSION, "files": files}, indent=2))
    _write_atomic(path / COMMIT_FILE, f"step {step}\n")


def checkpoint_problem(path: str | Path, verify_hashes: bool = True) -> str | None:
    """Why `path` is not a usable checkpoint, or None when it is complete and matches its manifest."""
    path = Path(path)
    if not (path / COMMIT_FILE).is_file():
        return "incomplete (no COMMIT marker; the save did not finish)"
    try:
        files = json.loads((path / MANIFEST_FILE).read_text())["files"]
        if not isinstance(files, dict) or not all(isinstance(entry, dict) and is_int(entry.get("bytes"))
                                                  and isinstance(entry.get("sha256"), str)
                                                  for entry in files.values()):
            raise TypeError("not {file: {bytes, sha256}}")
    except (OSError, ValueError, KeyError, TypeError):
        return f"corrupted ({MANIFEST_FILE} missing or unreadable)"
    for name, expected in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"corrupted ({name} is missing)"
        if file.stat().st_size != expected["bytes"]:
            return f"corrupted ({name} has {file.stat().st_size} bytes, manifest says {expected['bytes']})"
        if verify_hashes and _sha256(file) != expected["sha256"]:
            return f"corrupted ({name} does not match its SHA-256 in {MANIFEST_FILE})"
    if INFO_FILE not in files:
        return f"corrupted ({INFO_FILE} not in the manifest)"
    return None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name))]
    return sorted(found)


def _usable(path: Path, verify_hashes: bool) -> bool:
    problem = checkpoint_problem(path, verify_hashes)
    if problem:
        warnings.warn(f"skipping checkpoint {path}: {problem}", CheckpointWarning, stacklevel=3)
    return problem is None


def complete_checkpoints(root: str | Path, verify_hashes: bool = True) -> list[Path]:
    """Complete, verified step directories under `root`, oldest first; warns about each one skipped."""
    return [path for _, path in _step_dirs(Path(root)) if _usable(path, verify_hashes)]


def newest_checkpoint(root: str | Path, verify_hashes: bool = True) -> Path | None:
    """The newest complete, verified checkpoint under `root` (None if there is none)."""
    for _, path in reversed(_step_dirs(Path(root))):
        if _usable(path, verify_hashes):
            return path
    return None


def set_aside_corrupted(root: str | Path, newer_than: int) -> list[tuple[Path, Path, str]]:
    """Rename every committed but corrupted step folder after step `newer_than` to step-XXXXXXXX.corrupt
    (never deleted: the files may still be worth a look). A run resumed from an older checkpoint would
    otherwise meet it again when it reaches that step, and pruning would count it as complete.
    Returns (old path, new path, problem) for each folder moved."""
    moved = []
    for step, path in _step_dirs(Path(root)):
        if step <= newer_than or not (path / COMMIT_FILE).is_file():
            continue  # folders without COMMIT are a dead save's leftovers; the next save clears them
        problem = checkpoint_problem(path)
        if problem is None:
            continue
        target, copy = path.with_name(f"{path.name}.corrupt"), 1
        while target.exists():
            copy += 1
            target = path.with_name(f"{path.name}.corrupt-{copy}")
        os.rename(path, target)
        moved.append((path, target, problem))
    return moved


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (never an incomplete newer one); returns the deleted."""
    complete = complete_checkpoints(root, verify_hashes=False)
    doomed = complete[:-keep] if keep > 0 else complete
    for path in doomed:
        (path / COMMIT_FILE).unlink()  # first, so a crash mid-delete leaves an incomplete dir, never a bad one
        shutil.rmtree(path)
    return doomed


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or the newest complete one under a root of step-XXXXXXXX folders."""
    path = Path(path)
    if (path / COMMIT_FILE).exists() or (path / INFO_FILE).exists() or (path / ".metadata").exists():
        problem = checkpoint_problem(path)
        if problem:
            raise SpecError("checkpoint", str(path), problem)
        return path
    newest = newest_checkpoint(path)
    if newest is None:
        raise SpecError("checkpoint", str(path), "no complete checkpoint here (expected a folder with COMMIT, "
                                                 "or step-XXXXXXXX folders holding one)")
    return newest


def read_checkpoint_info(path: str | Path) -> dict:
    """fivefold.json of a checkpoint, with "model" turned into a ModelSpec."""
    path = Path(path)
    try:
        info = json.loads((path / INFO_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise SpecError("checkpoint", str(path / INFO_FILE), f"unreadable ({exc})") from None
    check_info_shape(info, str(path / INFO_FILE))
    info["model"] = model_from_dict(info["model"])
    return info


def check_info_shape(info: object, source: str) -> None:
    """fivefold.json as save_checkpoint writes it: each key fivefold reads back has its type, or one line
    naming the file and the key (a hand-edited or foreign file must not reach a traceback in resume or convert)."""
    fields = Fields(info, source)
    if fields.data.get("format") != FORMAT:
        raise fields.fail("format", fields.data.get("format"), f"expected {FORMAT!r}")
    fields.table("model")
    if fields.data.get("plan") is not None:
        Fields(fields.table("plan"), f"{source}:plan").table("plan")
    extra = Fields(fields.table("extra", {}), f"{source}:extra")
    if extra.data.get("train_state") is None:
        return
    state = Fields(extra.table("train_state"), f"{source}:extra.train_state")
    state.count("step", minimum=0)
    loader = Fields(state.table("loader"), f"{source}:extra.train_state.loader")
    loader.count("seed", minimum=0, limit=2**63 - 1)
    loader.count("seq_len")
    loader.count("samples_seen", minimum=0, limit=2**63 - 1)
    state.table("lr_schedule", {})
    state.table("optimizer", {})  # the optimizer settings a resume must repeat (resume.check_resumable)


@contextmanager
def _single_process_is_intended():
    """DCP warns on every single-process save/load, which is how `convert` and tests use it on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_checkpoint(state: dict, spec: ModelSpec, path: str | Path, step: int = 0, plan: Plan | None = None,
                    extra: dict | None = None, before_commit: Callable[[Path], object] | None = None) -> Path:
    """DCP-save `state` ({"model": ..., ...}) into `path` and commit it. Call on every rank of the
    process group when one exists (DCP gathers on rank 0, which then writes the metadata and COMMIT).
    `before_commit(path)` adds files of its own first (they enter the manifest)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    leader = not distributed or dist.get_rank() == 0
    if (path / COMMIT_FILE).exists():
        raise SpecError("checkpoint", str(path), "already holds a complete checkpoint; choose a new directory")
    if leader and path.exists() and any(path.iterdir()):
        if not ((path / ".metadata").exists() or any(path.glob("*.distcp"))):
            raise SpecError("checkpoint", str(path), "exists, is not empty and is not a checkpoint; "
                                                     "choose a new directory")
        shutil.rmtree(path)  # leftovers of a save that died: stale shards must not enter the manifest
    if distributed:
        dist.barrier()
    with _single_process_is_intended():
        dcp.save(state, checkpoint_id=str(path), no_dist=not distributed)
    if leader:
        if before_commit is not None:
            before_commit(path)
        finalize_checkpoint(path, spec, step, plan, extra)
    if distributed:
        dist.barrier()  # nobody moves on (or prunes) before COMMIT exists
    return path


def save_model_checkpoint(model_state_dict: dict, spec: ModelSpec, path: str | Path, step: int = 0,
                          plan: Plan | None = None, before_commit: Callable[[Path], object] | None = None) -> Path:
    """A model-only checkpoint (what `fivefold convert` writes)."""
    return save_checkpoint({"model": model_state_dict}, spec, path, step, plan, before_commit=before_commit)


def check_model_matches(path: Path, model_state_dict: dict[str, torch.Tensor]) -> None:
    """Every tensor the model wants exists in the checkpoint with the same (global) shape."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved_spec = read_checkpoint_info(path)["model"]
    for name, tensor in model_state_dict.items():
        key = f"model.{name}"
        if key not in saved:
            raise SpecError(f"{path}: model.{name}", None, f"missing from the checkpoint (saved from model "
                                                           f"{saved_spec.name}, {saved_spec.layers} layers)")
        shape = tuple(getattr(saved[key], "size", ()))
        if shape != tuple(tensor.shape):
            raise SpecError(f"{path}: model.{name}", list(shape), f"the model expects shape {list(tensor.shape)}; "
                            f"the checkpoint holds model {saved_spec.name} (hidden={saved_spec.hidden}, "
                            f"vocab={saved_spec.vocab})")


def load_model_state_dict(path: str | Path, model: nn.Module) -> dict:
    """Load the model weights of a checkpoint (a step folder, or a root: its newest) into `model` in place.

    Everything is checked before any tensor is read; returns the checkpoint's info (fivefold.json).
    """
    import torch.distributed.checkpoint as dcp

    import torch.distributed as dist

    path = resolve_checkpoint(path)
    state = model.state_dict()
    check_model_matches(path, state)
    distributed = dist.is_available() and dist.is_initialized()
    with _single_process_is_intended():
        dcp.load({"model": state}, checkpoint_id=str(path), no_dist=not distributed)
    model.load_state_dict(state)
    return read_checkpoint_info(path)
