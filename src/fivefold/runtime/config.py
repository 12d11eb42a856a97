"""RunConfig: what one training run needs beyond its Plan, checked once, and written back as `train` flags.

The fields named like a `fivefold train` flag (steps -> --steps, grad_clip -> --grad-clip) ARE those flags:
`from_flags` reads them from the parsed command line, `validate` checks them, and `to_flags` writes the
non-default ones back for the torchrun line each worker machine runs. The fields in DERIVED are filled in by
the launcher (the plan text, the resolved checkpoint, the run folder) and never travel as flags.
No torch import: the CLI checks a run before anything heavy is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from typing import Any, Mapping

from fivefold.errors import SpecError, require
from fivefold.runtime.schedule import check_optimizer_flags, lr_at, optimizer_record
from fivefold.spec import Plan, plan_from_dict
from fivefold.spec.datasource import data_paths
from fivefold.spec.job import check_wandb_project, parse_profile_steps, seconds_or_off
from fivefold.spec.diloco import DILOCO_FLAGS, DiLoCoSpec, check_diloco_flags, spec_from_flags

# What --expert-gemm and --fp8-recipe take (models/moe.py GroupedExperts and runtime/float8.py run them; kept here
# without torch so the CLI checks them before anything heavy is loaded).
EXPERT_GEMMS = ("auto", "grouped", "loop")
RUNTIME_FP8_RECIPES = ("tensorwise", "rowwise")

MAX_LR = 10.0  # a peak learning rate above this diverges on the first step
MAX_TIMEOUT_S = 7 * 24 * 3600  # torch keeps collective timeouts in milliseconds; a week is already no timeout
MAX_FACTOR = 1e6  # gradient norms and slowdown factors
MAX_TERM_GRACE_S = 65535  # sbatch --signal=B:TERM@SECONDS takes at most this


@dataclass
class RunConfig:
    """Everything a worker needs; small and picklable, so the launcher can hand it to each process."""

    plan_toml: str  # the Plan as TOML text
    steps: int = 10  # optimizer steps
    seed: int = 0  # seed of the weights and of the data order
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 2  # linear warmup steps before the cosine decay
    grad_clip: float = 1.0  # max global gradient norm
    data: str | None = None  # token file (.bin/.npy) or text file; None = the built-in corpus
    tokenizer: str | None = None  # HF tokenizer.json for text data; None = bytes
    text_field: str = "text"  # the column of JSONL / Parquet / `datasets` rows that holds the text
    data_change: str = "refuse"  # allow: a resumed run may change --data (runtime/prepare.py, data/loader.py)
    eval_data: str | None = None  # validation data, any --data form; None = no evaluation
    eval_every: int = 0  # evaluate every N steps (and after the last); 0 = only after the last step
    eval_batches: int = 4  # global batches per evaluation (the same ones every time, under every plan)
    device: str = "auto"  # cpu | cuda | auto
    metrics_file: str | None = None  # JSON lines, written by rank 0
    tensorboard: str | None = None  # folder of TensorBoard event files (per-step scalars), written by rank 0
    wandb: str | None = None  # Weights & Biases project (runtime/tracking.py), written by rank 0
    profile_steps: str | None = None  # "A-B": torch.profiler traces of steps A..B per rank (runtime/profiling.py)
    show_progress: bool = True  # rank 0 draws progress (bar on a terminal, lines otherwise)
    progress_to_stderr: bool = False  # keep stdout for a JSON summary
    trace: bool = False  # time every action of a few steps on every rank (runtime/trace.py)
    checkpoint_dir: str | None = None  # root of step-XXXXXXXX checkpoints; None = no saving
    checkpoint_every: int = 0  # save every K steps (and always after the last step); 0 = only at the end
    keep: int = 3  # complete checkpoints kept (older ones are deleted)
    checkpoint_async: bool = True  # write in the background; False = training waits for the write
    resume: bool | str = False  # --resume (True: the newest checkpoint, which must exist) or "auto" (or start fresh)
    overwrite: bool = False  # replace another run's metrics file (and the run folder's events, trace, profiles)
    save_on_term_within: float | str | None = None  # SIGTERM: save when the newest checkpoint is this many seconds
    #                                                 of steps behind; "off"; None = 0 under Slurm, off elsewhere
    term_grace: int = 120  # seconds after SIGTERM before the workers are killed (launcher, sbatch --signal)
    resume_from: str | None = None  # the checkpoint folder to continue from (the launcher picks the newest)
    init_from_hf: str | None = None  # a Hugging Face Llama folder giving the initial weights
    run_dir: str | None = None  # RUN/events.jsonl and RUN/pids/ (elastic/events.py); None = not recorded
    max_loss_spike: float = 3.0  # skip the update when the loss exceeds this x the running median; 0 = off
    max_bad_steps: int = 3  # bad steps in a row before rolling back to the newest checkpoint; 0 = never
    straggler_factor: float = 1.5  # report a rank computing this much slower than the median; 0 = off
    straggler_patience: int = 3  # ... for this many steps in a row
    collective_timeout: float = 600.0  # seconds a collective may wait for a peer before the step fails
    progress_file: str | None = None  # rank 0 writes the last finished step here (the launcher's interrupt line)
    metrics_every: int = 10  # gather per-rank metrics every N steps (runtime/bookkeeping.py)
    compile: bool = False  # torch.compile each transformer block (runtime/parallelize.py apply_compile)
    expert_gemm: str = "auto"  # MoE experts: auto | grouped (torch._grouped_mm) | loop (a GEMM per expert)
    fp8_recipe: str | None = None  # --dtype fp8: tensorwise (default) | rowwise (runtime/float8.py)
    lr_schedule: str = "cosine"  # cosine | wsd | linear | constant, after the warmup (runtime/schedule.py)
    min_lr: float | None = None  # where the decay ends; None = 10% of --lr
    decay_steps: int | None = None  # WSD: the last steps that decay to min_lr; None = 20% of the steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay of matrices (none on norms and biases)
    betas: str = "0.9,0.95"  # AdamW betas, two numbers (GPT-3 / Llama)
    eps: float = 1e-8  # AdamW epsilon
    dp_sync: str = "sync"  # sync: gradients summed over dp every step | diloco: outer replicas (spec/diloco.py)
    sync_every: int = 50  # DiLoCo H: inner steps between two syncs of one fragment
    outer_lr: float = 0.7  # outer SGD learning rate
    outer_momentum: float = 0.9  # outer Nesterov momentum
    fragments: int = 1  # Streaming DiLoCo fragments P (1 = plain DiLoCo)
    overlap: int = 0  # Streaming DiLoCo: steps between a fragment's send and its apply
    outer_dtype: str = "fp32"  # dtype of the exchanged outer gradients: fp32 | bf16
    diloco_groups: int = 0  # outer replicas; 0 = the cluster's groups crossed by dp, else 2

    # Filled in by the launcher or the caller, never given as a `train` flag.
    DERIVED = frozenset({"plan_toml", "show_progress", "progress_to_stderr", "checkpoint_async", "resume_from",
                         "run_dir", "progress_file"})

    @property
    def plan(self) -> Plan:
        return plan_from_dict(tomllib.loads(self.plan_toml))

    @classmethod
    def flag_fields(cls) -> list[str]:
        """The fields that are `train` flags, in declaration order."""
        return [f.name for f in dataclasses.fields(cls) if f.name not in cls.DERIVED]

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], **derived: Any) -> RunConfig:
        """A config from parsed `train` flags (e.g. vars(argparse.Namespace)); other keys are ignored."""
        return cls(**{"plan_toml": "", **{name: flags[name] for name in cls.flag_fields() if name in flags},
                      **derived})

    def to_flags(self) -> list[str]:
        """The non-default `train` flags of this run, in field order (the torchrun worker line repeats them)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        flags: list[str] = []
        for name in self.flag_fields():
            value = getattr(self, name)
            if value is None or value is False or value == defaults[name]:
                continue
            option = "--" + name.replace("_", "-")
            flags += [option] if value is True else [option, str(value)]
        return flags

    def validate(self) -> None:
        """Raise SpecError (one line) on the first flag that cannot work; the plan is checked elsewhere."""
        from fivefold.checkpoint.resume import check_checkpoint_flags
        from fivefold.elastic.guard import check_guard_flags

        if self.trace and not self.metrics_file:
            raise SpecError("--trace", True, "needs --metrics-file RUN/metrics.jsonl: the trace is written next to it")
        check_checkpoint_flags(self.checkpoint_dir, self.checkpoint_every, self.keep, self.resume)
        check_guard_flags(self.max_loss_spike, self.max_bad_steps)
        require(self.collective_timeout > 0, "--collective-timeout", self.collective_timeout,
                "must be a positive number of seconds")
        require(self.straggler_factor == 0 or self.straggler_factor > 1, "--straggler-factor", self.straggler_factor,
                "must be above 1, or 0 to disable")
        require(self.straggler_patience >= 1, "--straggler-patience", self.straggler_patience,
                "must be at least 1 step")
        require(self.steps >= 1, "--steps", self.steps, "must be at least 1")
        require(self.metrics_every >= 1, "--metrics-every", self.metrics_every, "must be at least 1 step")
        check_fp8_recipe(self.fp8_recipe)
        require(self.expert_gemm in EXPERT_GEMMS, "--expert-gemm", self.expert_gemm, f"use one of {', '.join(EXPERT_GEMMS)}")
        self.validate_eval()
        self.validate_numbers()
        self.validate_job()
        check_optimizer_flags(self.lr, self.steps, self.warmup_steps, self.lr_schedule, self.min_lr,
                              self.decay_steps, self.weight_decay, self.betas, self.eps)
        self.validate_diloco()
        self.validate_paths()

    def validate_job(self) -> None:
        """The flags of a run as a cluster job: SIGTERM, resume, overwrite, data changes, tracking, profiling."""
        if self.save_on_term_within is not None:
            seconds_or_off(str(self.save_on_term_within))
        require(isinstance(self.term_grace, int) and 1 <= self.term_grace <= MAX_TERM_GRACE_S, "--term-grace",
                self.term_grace, f"must be whole seconds from 1 to {MAX_TERM_GRACE_S} (Slurm's --signal limit)")
        require(self.resume in (False, True, "auto"), "--resume", self.resume, "takes no value, or auto")
        require(not (self.overwrite and self.resume), "--overwrite", True, "a resumed run continues its metrics file; "
                "leave out --overwrite, or --resume to start the run anew")
        require(self.data_change in ("refuse", "allow"), "--data-change", self.data_change, "use one of refuse, allow")
        require(self.data_change == "refuse" or bool(self.resume), "--data-change", self.data_change,
                "only a resumed run can change its data; add --resume (or --resume auto)")
        if self.profile_steps is not None:
            require(bool(self.metrics_file), "--profile-steps", self.profile_steps,
                    "needs --metrics-file RUN/metrics.jsonl: the traces are written to RUN/profile/")
            parse_profile_steps(self.profile_steps, self.steps)
        if self.wandb is not None:
            check_wandb_project(self.wandb)

    def term_save_threshold(self) -> float | None:
        """Seconds of steps behind the newest checkpoint from which SIGTERM saves once more; None: never.
        By default 0 under Slurm (a requeued job then redoes nothing), off elsewhere."""
        import os

        if self.save_on_term_within is None:
            return 0.0 if os.environ.get("SLURM_JOB_ID") else None
        return None if self.save_on_term_within == "off" else float(self.save_on_term_within)

    def diloco_flags(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in DILOCO_FLAGS}

    def diloco(self, plan: Plan) -> DiLoCoSpec | None:
        """The outer loop of this run of `plan` (None: --dp-sync sync); SpecError when the plan cannot have it."""
        return spec_from_flags(self.diloco_flags(), plan)

    def validate_diloco(self) -> None:
        """--dp-sync and the DiLoCo flags alone; spec/diloco.py checks them against the plan."""
        check_diloco_flags(self.diloco_flags())

    def validate_numbers(self) -> None:
        """The optimizer and schedule flags: finite, positive where zero or less cannot train."""
        require(math.isfinite(self.lr) and 0 < self.lr <= MAX_LR, "--lr", self.lr,
                f"must be a positive finite number up to {MAX_LR:g}, e.g. 3e-3")
        require(math.isfinite(self.grad_clip) and 0 < self.grad_clip <= MAX_FACTOR, "--grad-clip", self.grad_clip,
                f"must be a positive finite gradient norm up to {MAX_FACTOR:g}, e.g. 1.0 (clipping cannot be turned off)")
        require(self.warmup_steps >= 0, "--warmup-steps", self.warmup_steps, "must be 0 or more")
        require(0 <= self.seed < 2**63, "--seed", self.seed, "must be an integer from 0 to 2**63-1")
        require(math.isfinite(self.collective_timeout) and self.collective_timeout <= MAX_TIMEOUT_S,
                "--collective-timeout", self.collective_timeout, f"must be a finite number of seconds up to "
                f"{MAX_TIMEOUT_S:,} (a week)")
        require(math.isfinite(self.max_loss_spike) and self.max_loss_spike <= MAX_FACTOR, "--max-loss-spike",
                self.max_loss_spike, f"must be a finite factor above 1 (at most {MAX_FACTOR:g}), or 0 to disable")
        require(math.isfinite(self.straggler_factor) and self.straggler_factor <= MAX_FACTOR, "--straggler-factor",
                self.straggler_factor, f"must be a finite factor above 1 (at most {MAX_FACTOR:g}), or 0 to disable")

    def validate_eval(self) -> None:
        """--eval-every / --eval-batches: counts, and only with --eval-data."""
        require(self.eval_every >= 0, "--eval-every", self.eval_every,
                "must be 0 (only after the last step) or a positive step count")
        require(self.eval_batches >= 1, "--eval-batches", self.eval_batches, "must be at least 1 global batch")
        if not self.eval_data:
            require(self.eval_every == 0, "--eval-every", self.eval_every, "needs --eval-data (validation data)")
            require(self.eval_batches == 4, "--eval-batches", self.eval_batches,
                    "needs --eval-data (validation data)")

    def optimizer_record(self) -> dict[str, Any]:
        """The optimizer and schedule settings a checkpoint records and a resume must repeat."""
        return optimizer_record(self.lr_schedule, self.min_lr, self.decay_steps, self.weight_decay, self.betas,
                                self.eps)

    def lr_of_step(self, step: int) -> float:
        """The learning rate of 0-based optimizer step `step`."""
        return lr_at(step, self.lr, self.warmup_steps, self.steps, self.lr_schedule, self.min_lr, self.decay_steps)

    def validate_paths(self) -> None:
        """Output paths of the right kind in a writable place; nothing is created here."""
        from fivefold.outputs import check_distinct_paths, check_metrics_file, check_output_dir

        check_distinct_paths([("--metrics-file", self.metrics_file), ("--checkpoint-dir", self.checkpoint_dir),
                              ("--tensorboard", self.tensorboard)],
                             [("--init-from-hf", self.init_from_hf),
                              *(("--data", path) for path in data_paths(self.data)),
                              *(("--eval-data", path) for path in data_paths(self.eval_data))])
        if self.metrics_file:
            check_metrics_file(self.metrics_file)
        if self.checkpoint_dir:
            check_output_dir(self.checkpoint_dir, "--checkpoint-dir")
        if self.tensorboard:
            check_output_dir(self.tensorboard, "--tensorboard")


def check_gpu_dtype(dtype: str) -> None:
    """The one fp16 refusal: the runtime has no loss scaling (CPU ranks compute in fp32 whatever the plan says)."""
    require(dtype != "fp16", "train.dtype", dtype, "fp16 needs loss scaling, which the runtime does not do; "
                                                   "use bf16 or fp32")


def check_fp8_recipe(recipe: str | None) -> None:
    """--fp8-recipe of `train`: a recipe the runtime runs (torchao's two), else one line naming what it does run."""
    if recipe is None or recipe in RUNTIME_FP8_RECIPES:
        return
    from fivefold.cost.fp8 import FP8_RECIPES

    runs = " or ".join(RUNTIME_FP8_RECIPES)
    if recipe in FP8_RECIPES:  # a Transformer Engine recipe the cost model prices for Megatron-Core
        raise SpecError("--fp8-recipe", recipe, f"is Transformer Engine's recipe, which the cost model prices for "
                        f"--stack megatron-core; fivefold's runtime trains {runs}")
    raise SpecError("--fp8-recipe", recipe, f"no such FP8 recipe; fivefold's runtime trains {runs}")
