"""Training checkpoints of one worker: asynchronous save, exact resume, resharding to another plan, and
initial weights from a Hugging Face folder. The loop calls three things:

    checkpointer = Checkpointer(config, plan, mesh, parts, optimizer, loader)
    first_step = checkpointer.start()      # resume (or take HF weights); the 0-based step to run next
    ... after each optimizer step:  checkpointer.step_done(step)
    checkpointer.close()                   # waits for the last save and commits it

What is saved, and why each part makes a resume exact or plan-independent:
    model, optimizer  torch.distributed.checkpoint (DCP) of FQN-keyed state dicts; DTensor shards carry
                      their global offsets, so any other dp/tp/pp/zero layout loads them resharded. The
                      optimizer state is flattened per parameter ("state.<fqn>.exp_avg"), so pipeline
                      stages that own other parameters find theirs (TorchTitan does the same).
    train_state       in fivefold.json: step, loader position (samples_seen, global) and LR schedule.
    rng               every rank's torch/numpy/python RNG states; restored when the layout is unchanged.
    diloco            (--dp-sync diloco) outer weights and momentum, resharded like the model; each outer
                      group's local weights and AdamW state under keys of its own (runtime/diloco.py).

Saving: rank 0 clears leftovers of a save that died, then every rank stages a CPU copy of its state
(training waits only for this copy) and DCP writes it from a background thread over a process group
of its own (gloo): two threads issuing collectives on one gloo group would interleave them. DCP's final
step gathers every rank's write results on rank 0 before it writes .metadata, so when rank 0's save
finishes every file exists: rank 0 then writes fivefold.json, the manifest and COMMIT (layout.py) and
prunes old checkpoints, still in the background. At most one save is in flight: the next save (and
close) first waits for the previous one.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, distribute_tensor

from fivefold.checkpoint.tokenizer_files import copy_tokenizer_files
from fivefold.checkpoint.layout import (COMMIT_FILE, finalize_checkpoint, prune_checkpoints, read_checkpoint_info,
                                        step_dir)
from fivefold.checkpoint.resume import LAYOUT_FIELDS, TRAIN_STATE, architecture_difference, describe_resume
from fivefold.data.loader import GlobalBatchLoader
from fivefold.errors import SpecError
from fivefold.runtime.config import RunConfig
from fivefold.runtime.diloco import OuterLoop
from fivefold.runtime.mesh import Mesh
from fivefold.spec import Plan

Log = Callable[[str], None]  # where rank 0's one-line notes go

# nice of the background writer and hasher: ~10% of a contended core (Linux CFS weight 110 vs 1024), so
# training keeps its cores on a CPU box while the write still finishes between saves.
BACKGROUND_NICE = 10
# Optimizer state keyed "state.<fqn>.<name>" / "param_groups.<fqn>.<name>": loadable by any stage layout.
OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class StageModels(nn.Module):
    """This rank's stage models seen as one model whose parameter names are the whole model's FQNs
    (a pipeline rank with interleaved stages holds several; torch's state-dict helpers take one module).
    It only holds references: the stage models keep running the forward passes."""

    def __init__(self, parts: dict[int, nn.Module], vocab_slices: nn.Module | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        # --vocab-parallel: tok_embeddings and output are this rank's rows, DTensors of the global shape.
        for part in (*parts.values(), *([vocab_slices] if vocab_slices is not None else [])):
            for key, block in getattr(part, "layers", {}).items():
                self.layers[key] = block
            for name in ("tok_embeddings", "pos_embeddings", "norm", "output"):
                if getattr(part, name, None) is not None:
                    setattr(self, name, getattr(part, name))


def yield_cores_to_training() -> None:
    """Lower the calling (background) thread's CPU priority: on a CPU box the checkpoint writer and the
    hashing otherwise take cores from the training step. Linux applies nice per thread."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


class BackgroundWriter(FileSystemWriter):
    """DCP's file writer, at low priority in the background thread async_save runs it in."""

    def write_data(self, plan, planner):
        yield_cores_to_training()
        return super().write_data(plan, planner)


def rng_state() -> bytes:
    """This process's random number generator states (torch CPU and CUDA, numpy, python), pickled."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return pickle.dumps(state)


def set_rng_state(blob: bytes) -> None:
    state = pickle.loads(blob)
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@torch.no_grad()
def copy_full_weights(model: nn.Module, full_state: dict[str, torch.Tensor]) -> None:
    """Copy whole (unsharded) tensors, keyed by FQN, into `model`'s possibly sharded parameters: each rank
    keeps its own shard of the full tensor it already holds, without communication (as init_weights does)."""
    for name, tensor in get_model_state_dict(model).items():
        full = full_state[name]
        local = tensor
        if isinstance(tensor, DTensor):
            full = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            local = tensor.to_local()
        local.copy_(full.to(device=local.device, dtype=local.dtype))


def same_layout(saved_plan: dict | None, plan: Plan) -> bool:
    """Whether a checkpoint was saved by this very layout (then every rank's RNG state is its own)."""
    if not saved_plan:
        return False
    now = plan.to_dict()["plan"]
    return all(saved_plan["plan"].get(name) == now.get(name) for name in LAYOUT_FIELDS)


class Checkpointer:
    """Saves and loads one worker's share of a training run (see the module docstring)."""

    def __init__(self, config: RunConfig, plan: Plan, mesh: Mesh, parts: dict[int, nn.Module],
                 optimizer: torch.optim.Optimizer, loader: GlobalBatchLoader, outer: OuterLoop | None = None,
                 vocab_slices: nn.Module | None = None) -> None:
        self.config = config
        self.outer = outer
        self.plan = plan
        self.rank = mesh.rank
        self.optimizer = optimizer
        self.loader = loader
        self.model = StageModels(parts, vocab_slices)
        self.root = Path(config.checkpoint_dir) if config.checkpoint_dir else None
        self.saving = self.root is not None
        # The group DCP talks over (in the background thread when saving asynchronously).
        self.group = dist.new_group(backend="gloo") if (self.saving or config.resume_from) else None
        self.stager = None
        if self.saving and config.checkpoint_async:
            # One stager for the whole run: it keeps its CPU copies and refills them at the next save.
            cuda = mesh.device.type == "cuda"
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                       use_async_staging=False, use_non_blocking_copy=False))
        self.finisher = ThreadPoolExecutor(max_workers=1) if self.saving and self.rank == 0 else None
        self.pending: Future | None = None  # the save in flight (rank 0: its commit)
        self.pending_step: int | None = None  # ... and its step
        self.newest_step = 0  # the step of the newest checkpoint: saved, in flight, or resumed from
        # Seconds per save: training blocked (all of it), of which waiting for the previous save, and
        # (rank 0) from the save call until COMMIT was written.
        self.seconds: dict[str, list[float]] = {"blocked": [], "waiting": [], "until_commit": []}

    # --- state ------------------------------------------------------------------------------
    def schedule(self) -> dict:
        return {"lr": self.config.lr, "warmup_steps": self.config.warmup_steps, "steps": self.config.steps}

    def train_state(self, step: int) -> dict:
        """Plain ints and strings, the same on every rank; written into fivefold.json by rank 0."""
        return {"step": step, "loader": self.loader.state_dict(), "lr_schedule": self.schedule(),
                "optimizer": self.config.optimizer_record()}

    def key(self, name: str) -> str:
        """Where this rank's "model" / "optimizer" state lives: DiLoCo's outer groups keep their own."""
        return self.outer.group_key(name) if self.outer is not None else name

    def state_dict(self) -> dict:
        state = {self.key("model"): get_model_state_dict(self.model),
                 self.key("optimizer"): get_optimizer_state_dict(self.model, self.optimizer,
                                                                 options=OPTIMIZER_OPTIONS),
                 "rng": {f"rank{self.rank}": rng_state()}}
        if self.outer is not None:
            state["diloco"] = self.outer.state_dict()
        return state

    # --- start: resume or initial weights ---------------------------------------------------
    def start(self, log: Log | None = None) -> int:
        """Load the checkpoint to resume from, or the Hugging Face weights; the 0-based step to run next."""
        if self.config.resume_from:
            return self.load(Path(self.config.resume_from), log)
        if self.config.init_from_hf:
            self.load_hf(self.config.init_from_hf, log)
        return 0

    def load_hf(self, folder: str, log: Log | None = None) -> None:
        from fivefold.checkpoint.hf import load_hf_state_dict

        spec, state = load_hf_state_dict(folder, dtype=torch.float32)
        field = architecture_difference(self.plan.model, spec)
        if field is not None:
            raise SpecError(f"{Path(folder) / 'config.json'}: model.{field}", getattr(spec, field),
                            f"the plan's model has {field}={getattr(self.plan.model, field)!r}; "
                            "use a plan of this model")
        copy_full_weights(self.model, state)
        if log:
            log(f"initial weights from Hugging Face folder {folder} ({spec.name}, {spec.num_params():,} parameters)")

    def load(self, path: Path, log: Log | None = None) -> int:
        info = read_checkpoint_info(path)
        train_state = info["extra"][TRAIN_STATE]
        saved_keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata

        def saved(name: str) -> str:  # this outer group's own key when saved (same outer groups), else group 0's
            key = self.key(name)
            return key if any(k.startswith(key + ".") for k in saved_keys) else name
        state = {saved("model"): get_model_state_dict(self.model),
                 saved("optimizer"): get_optimizer_state_dict(self.model, self.optimizer, options=OPTIMIZER_OPTIONS)}
        with_outer = self.outer is not None and any(k.startswith("diloco.") for k in saved_keys)
        if with_outer:
            state["diloco"] = self.outer.state_dict()
        rng_key = f"rank{self.rank}"
        restore_rng = same_layout(info.get("plan"), self.plan) and f"rng.{rng_key}" in saved_keys
        if restore_rng:
            state["rng"] = {rng_key: b""}
        # Each rank asks for its own keys and shards; DCP reads the overlapping parts of the saved chunks.
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        set_model_state_dict(self.model, state[saved("model")])
        set_optimizer_state_dict(self.model, self.optimizer, state[saved("optimizer")], options=OPTIMIZER_OPTIONS)
        if with_outer:
            self.outer.load_state_dict(state["diloco"])
        elif self.outer is not None:  # a checkpoint of synchronous training: the outer loop starts from it
            self.outer.reset_to_local()
        self.loader.load_state_dict(train_state["loader"], allow_change=self.config.data_change == "allow")
        if restore_rng:
            set_rng_state(state["rng"][rng_key])
        if log:
            log(describe_resume(path, info, self.plan, self.schedule()))
        self.newest_step = int(train_state["step"])
        return self.newest_step

    # --- saving -------------------------------------------------------------------------------
    def step_done(self, step: int) -> bool:
        """Called after optimizer step `step` (1-based): saves every checkpoint_every steps and at the end.
        Whether it saved."""
        if not self.saving:
            return False
        every = self.config.checkpoint_every
        if (every and step % every == 0) or step == self.config.steps:
            self.save(step)
            return True
        return False

    def save(self, step: int) -> None:
        start = time.perf_counter()
        self.wait()
        self.seconds["waiting"].append(time.perf_counter() - start)
        path = step_dir(self.root, step)
        if self.rank == 0:
            if (path / COMMIT_FILE).exists():
                raise SpecError("--checkpoint-dir", str(path), "already holds a complete checkpoint of this step; "
                                                               "resume from it or choose a new folder")
            if path.exists():
                shutil.rmtree(path)  # a save of this step that died: its stale files must not enter the manifest
            path.mkdir(parents=True)
        dist.barrier(group=self.group)
        self.newest_step = step
        state = self.state_dict()
        train_state = self.train_state(step)
        if self.stager is None:
            dcp.save(state, checkpoint_id=str(path), process_group=self.group)
            if self.rank == 0:
                self.commit(path, step, train_state, start)
        else:
            upload = dcp.async_save(state, storage_writer=BackgroundWriter(str(path)), process_group=self.group,
                                    async_stager=self.stager)
            self.pending = self.finisher.submit(self.commit_after, upload, path, step, train_state, start) \
                if self.rank == 0 else upload
            self.pending_step = step
        self.seconds["blocked"].append(time.perf_counter() - start)

    def commit_after(self, upload: Future, path: Path, step: int, train_state: dict, start: float) -> None:
        yield_cores_to_training()
        upload.result()  # raises if any rank failed to write (no COMMIT then)
        self.commit(path, step, train_state, start)

    def commit(self, path: Path, step: int, train_state: dict, start: float) -> None:
        """Rank 0, once every rank's files are written: the tokenizer's files, fivefold.json, manifest, COMMIT;
        then prune."""
        copy_tokenizer_files(self.config.tokenizer, path)
        finalize_checkpoint(path, self.plan.model, step, self.plan, extra={TRAIN_STATE: train_state})
        self.seconds["until_commit"].append(time.perf_counter() - start)
        # Every earlier save of this run is committed, so a folder without COMMIT is a dead run's leftover.
        for folder in self.root.glob("step-*"):
            if folder.is_dir() and not (folder / COMMIT_FILE).exists():
                shutil.rmtree(folder, ignore_errors=True)
        prune_checkpoints(self.root, self.config.keep)

    def wait(self) -> int | None:
        """Wait for the save in flight (raises its error, if it failed); its step, None when none was."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        step, self.pending_step = self.pending_step, None
        pending.result()
        return step

    def close(self) -> None:
        """Finish the last save; every rank leaves only when the checkpoint is committed."""
        try:
            self.wait()
            if self.group is not None:
                dist.barrier(group=self.group)
        finally:
            if self.finisher is not None:
                self.finisher.shutdown(wait=True)
            if self.stager is not None:
                self.stager.close()
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None


def log_to(stream) -> Log:
    def log(line: str) -> None:
        print(line, file=stream or sys.stdout, flush=True)
    return log
