"""`fivefold dryrun`: every distinct kind of rank of a plan, built and stepped by the real runtime on fake
tensors (dryrun/rank.py, one process per rank), next to the cost model's estimate for the same rank.

Kinds of rank: ranks at the same pipeline position do the same work on the same shapes (tp, cp and dp
ranks hold equal shards), so one rank per pp rank covers the plan: the first pp rank holds the embedding,
the last the LM head, and each pp rank keeps its own count of micro-batches in flight.

What is compared: the peak PyTorch accounts for the rank's tensors against the estimate's tensor memory
(params + grads + optimizer + activations + transient, cost/memory.py RankMemory). The estimate's
`reserved` part (CUDA context, workspaces, allocator slack) is no tensor; it is added to the measured peak
only to decide whether the rank fits its device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fivefold.errors import FivefoldError, SpecError
from fivefold.spec import Plan

GIB = 2**30
PARTS = ("params", "grads", "optimizer", "activations", "transient")
BALANCED_NOTE = ("MoE token splits fixed at the balanced expectation: each expert computes tokens x top_k / experts "
                 "copies per micro-batch (the router's real choice needs token values)")


class DryRunBuildError(FivefoldError):
    """A rank of the plan does not build or does not step under the runtime (a launch would fail)."""


@dataclass
class RankResult:
    """One kind of rank: what the dry run accounted and what the cost model estimated, in bytes."""

    rank: int  # the representative global rank (dp = cp = tp = 0 at this pp rank)
    pp_stage: int  # its pipeline rank
    stages: list[int]  # the virtual stages it holds
    holds: list[str]  # "embedding" / "head" when it holds them
    measured: dict[str, float]  # peak and parts (PARTS), bytes
    kinds: dict[str, float]  # the tracker's own kinds at the peak, bytes
    estimated: dict[str, float]  # peak (tensor memory) and parts, bytes
    reserved: float  # the estimate's non-tensor bytes (context, workspaces)
    capacity: float  # the device's memory, bytes
    micro_batches: int  # micro-batches the rank ran in its step
    seconds: float  # wall time of its build and step
    cpu_seconds: float = 0.0  # CPU time of its worker process (imports, build, step)

    @property
    def error(self) -> float:
        """Signed relative error of the estimate against the measured peak."""
        return self.estimated["peak"] / self.measured["peak"] - 1.0 if self.measured["peak"] else 0.0

    @property
    def overflow(self) -> float:
        """Bytes by which the rank's measured tensors plus the reserved bytes exceed its device (<= 0 fits)."""
        return self.measured["peak"] + self.reserved - self.capacity

    def to_dict(self) -> dict:
        def gib(parts: dict[str, float]) -> dict[str, float]:
            return {name: round(value / GIB, 4) for name, value in parts.items()}

        return {"rank": self.rank, "pp_stage": self.pp_stage, "stages": self.stages, "holds": self.holds,
                "measured_peak_gib": round(self.measured["peak"] / GIB, 4),
                "estimated_peak_gib": round(self.estimated["peak"] / GIB, 4),
                "error": round(self.error, 4),
                "measured_gib": gib({k: self.measured[k] for k in PARTS}),
                "estimated_gib": gib({k: self.estimated[k] for k in PARTS}),
                "tracker_gib": gib(self.kinds), "reserved_gib": round(self.reserved / GIB, 4),
                "capacity_gib": round(self.capacity / GIB, 4), "overflow_gib": round(self.overflow / GIB, 4),
                "fits": self.overflow <= 0, "micro_batches": self.micro_batches,
                "seconds": round(self.seconds, 2), "cpu_seconds": round(self.cpu_seconds, 2)}


@dataclass
class DryRun:
    """The dry run of one plan."""

    describe: str
    device: str  # "cuda": the runtime's GPU configuration (bf16 mixed precision); "cpu": its CPU one
    world_size: int
    stack: str
    ranks: list[RankResult] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # what the dry run fixed that a real run decides

    @property
    def fits(self) -> bool:
        return all(r.overflow <= 0 for r in self.ranks)

    def to_dict(self) -> dict:
        return {"plan": self.describe, "device": self.device, "world_size": self.world_size, "stack": self.stack,
                "fits": self.fits, "seconds": round(self.seconds, 2), "notes": self.notes,
                "ranks": [r.to_dict() for r in self.ranks]}


# Micro-batches one rank steps through on fake tensors: each costs a full-scale forward and backward of its
# stages (~0.1-1 s of CPU at 70B scale), and the peak is reached within the first 2 x pp of them (1F1B's warm-up),
# so a larger step is refused at once rather than run for hours without an end in sight.
MAX_DRY_RUN_MICRO_BATCHES = 1024


def check_dry_run_size(plan: Plan) -> None:
    if plan.vocab_parallel:  # its vocabulary passes are collectives the fake process group would have to answer
        raise SpecError("--vocab-parallel", True, "the dry run does not build vocabulary-parallel ranks yet; "
                        "`fivefold estimate` costs the plan, `fivefold train` runs it")
    most = max(plan.micro_batches_of_replica(replica) for replica in range(plan.dp))
    if most > MAX_DRY_RUN_MICRO_BATCHES:
        raise SpecError("plan.num_micro_batches", most, f"micro-batches on one rank, more than the dry run steps "
                        f"({MAX_DRY_RUN_MICRO_BATCHES:,}); raise --micro-batch or lower --global-batch (the memory "
                        "peak does not grow past 2 x pp micro-batches)")


def default_device(plan: Plan) -> str:
    """cuda for GPU clusters, cpu for CPU ones."""
    return "cpu" if all(g.device.name == "cpu" for g in plan.cluster.groups) else "cuda"


def representative_ranks(plan: Plan) -> list[int]:
    """One global rank per pipeline rank (see the module docstring)."""
    return [plan.rank_of(pp=r) for r in range(plan.pp)]


def measure_in_subprocess(plan: Plan, rank: int, gpu: bool, timeout: float = 1800.0) -> dict:
    """dryrun/worker.py's JSON for one rank, run in a fresh Python process with this fivefold on its path."""
    source_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("OMP_NUM_THREADS", "1")
    request = json.dumps({"plan_toml": plan.to_toml(), "rank": rank, "gpu": gpu})
    done = subprocess.run([sys.executable, "-m", "fivefold.dryrun.worker"], input=request, capture_output=True,
                          text=True, env=env, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the dry-run worker of rank {rank} exited with {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def _rank_result(plan: Plan, rank: int, answer: dict, rank_memory: list) -> RankResult:
    pp_rank = plan.coords(rank)["pp"]
    if "error" in answer:
        raise DryRunBuildError(f"rank {rank} (pp stage {pp_rank}) does not build or step under the runtime: "
                               f"{answer['error']}")
    memory = rank_memory[pp_rank]
    estimated = {name: getattr(memory, name) for name in PARTS}
    estimated["peak"] = sum(estimated.values())
    stages = plan.stages_of(pp_rank)
    holds = (["embedding"] if 0 in stages else []) + (["head"] if plan.num_stages - 1 in stages else [])
    capacity = plan.cluster.group_of(plan.placement[rank]).device.memory_bytes
    return RankResult(rank=rank, pp_stage=pp_rank, stages=stages, holds=holds,
                      measured={"peak": answer["peak"], **answer["parts"]}, kinds=answer["kinds"],
                      estimated=estimated, reserved=memory.reserved, capacity=capacity,
                      micro_batches=answer["micro_batches"], seconds=answer["seconds"],
                      cpu_seconds=answer.get("cpu_seconds", 0.0))


def dry_run(plan: Plan, device: str | None = None, stack_name: str = "fivefold",
            on_rank: Callable[[RankResult], None] | None = None, jobs: int | None = None) -> DryRun:
    """Dry-run every kind of rank of `plan`; raise DryRunBuildError on the first rank that fails."""
    check_dry_run_size(plan)  # before the imports below load torch: a refusal comes at once
    from fivefold.cost import estimate, stack_named
    from fivefold.runtime.launch import check_runnable

    device = device or default_device(plan)
    # What `fivefold train` refuses before it starts, less the count of GPUs on this machine (none needed here).
    check_runnable(plan, plan.world_size, device, gpus=plan.world_size)
    stack = stack_named(stack_name)
    predicted = estimate(plan, stack)
    result = DryRun(plan.describe(), device, plan.world_size, stack.name)
    if plan.model.is_moe:  # fake tensors have no values to route by (dryrun/rank.py balanced_moe)
        result.notes.append(BALANCED_NOTE)
    started = time.perf_counter()
    ranks = representative_ranks(plan)
    # One process per kind of rank, as many at once as there are cores (each is single-threaded).
    with ThreadPoolExecutor(max_workers=max(1, min(len(ranks), jobs or os.cpu_count() or 1))) as pool:
        answers = pool.map(lambda rank: measure_in_subprocess(plan, rank, gpu=device == "cuda"), ranks)
        for rank, answer in zip(ranks, answers):
            one = _rank_result(plan, rank, answer, predicted.rank_memory)
            result.ranks.append(one)
            if on_rank is not None:
                on_rank(one)
    result.seconds = time.perf_counter() - started
    return result
