"""What the cost model returns: StageCost (one virtual stage, one micro-batch), Estimate (one plan, in
full: `fivefold estimate`) and Score (what the planner ranks by). How the numbers are composed: step.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.cost.memory import RankMemory
from fivefold.spec.units import GIB


@dataclass(frozen=True)
class StageCost:
    """One virtual stage, one micro-batch: seconds and bytes (see the module docstring)."""

    forward: float  # forward compute + its exposed (non-overlapped) TP/CP/EP communication
    backward_input: float  # input-gradient part of backward (+ the recompute forward when recompute != none)
    backward_weight: float  # weight-gradient part of backward
    send_activation: float  # p2p time of one micro-batch's activation to the next stage (gradient back: same)
    activation_bytes: float  # memory held per in-flight micro-batch on this stage
    static_bytes: float  # params + grads + optimizer states (+ embedding/LM head on first/last stage)
    layers: int = 0  # transformer layers in this stage
    pp_rank: int = 0  # the pipeline rank that runs it
    recompute: float = 0.0  # compute seconds of the recompute forward inside backward_input
    tp_comm: float = 0.0  # TP communication seconds inside forward + backward_input
    cp_comm: float = 0.0  # context-parallel communication seconds inside forward + backward_input
    ep_comm: float = 0.0  # expert-parallel all-to-all seconds inside forward + backward_input
    host_overhead: float = 0.0  # seconds the GPU waits on kernel launches inside the passes


@dataclass
class Estimate:
    """What one plan costs. All times in seconds per optimizer step unless named otherwise."""

    describe: str  # Plan.describe() of the plan
    world_size: int
    micro_batches: int  # per replica per step
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float  # model FLOPs (no recompute) per second per GPU, in TFLOP/s
    hardware_tflops_per_gpu: float  # including recompute
    mfu: float  # model FLOPs / (step time x world size x peak FLOP/s of the dtype)
    bubble_fraction: float  # share of the step the slowest pipeline rank idles in fill and drain
    fits: bool  # every rank's peak memory within its device memory less the headroom
    memory: RankMemory  # the rank with the highest peak
    peak_pp_rank: int  # which pipeline rank that is
    capacity_bytes: float  # usable device memory of that rank (after headroom)
    rank_memory: list[RankMemory]  # per pipeline rank
    stage_costs: list[StageCost]  # per virtual stage, model order
    pipeline_s: float
    bubble_s: float
    pp_comm_s: float
    dp_comm_s: float  # total data-parallel / ZeRO communication of one rank per step
    dp_comm_exposed_s: float  # the part not hidden behind compute
    optimizer_s: float
    breakdown_s: dict[str, float] = field(default_factory=dict)  # sums to step_time_s
    stack: str = "fivefold"  # cost.stack.DEFAULT_STACK
    notes: list[str] = field(default_factory=list)  # one line each: what the stack cannot run, extrapolation
    error_band: float | None = None  # expected relative error of the step time (development-set residuals)
    mfu_basis: str = ""  # which peak MFU is counted against ("bf16 peak" under fp8)

    def to_dict(self) -> dict:
        """The `fivefold estimate --json` object."""
        memory = self.memory.to_dict()
        return {
            "plan": self.describe, "world_size": self.world_size, "micro_batches": self.micro_batches,
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s / self.world_size,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction, "fits": self.fits,
            "memory_gib": {"peak_per_rank": memory.pop("peak"), **memory, "capacity": self.capacity_bytes / GIB,
                           "peak_pp_rank": self.peak_pp_rank,
                           "per_pp_rank": [round(m.total / GIB, 3) for m in self.rank_memory]},
            "breakdown_s": dict(self.breakdown_s),
            "dp_comm_s": self.dp_comm_s, "dp_comm_exposed_s": self.dp_comm_exposed_s,
            "optimizer_s": self.optimizer_s, "pipeline_s": self.pipeline_s, "stack": self.stack,
            "notes": list(self.notes), "error_band": self.error_band, "mfu_basis": self.mfu_basis,
            "stages": [{"pp_rank": s.pp_rank, "layers": s.layers, "forward_s": s.forward,
                        "backward_input_s": s.backward_input, "backward_weight_s": s.backward_weight,
                        "send_activation_s": s.send_activation, "activation_gib": s.activation_bytes / GIB,
                        "static_gib": s.static_bytes / GIB} for s in self.stage_costs],
        }


@dataclass(frozen=True)
class Score:
    """What the planner ranks by: score_layout, the step without per-stage detail (step_time_s is inf for a
    layout the planner asked to time only if it fits and that does not)."""

    step_time_s: float
    peak_bytes: float  # the highest per-rank peak
    peak_ratio: float  # highest peak / usable memory of that rank (<= 1 fits)
    peak_pp_rank: int
    fits: bool
