"""TrainSpec: what one optimizer step consumes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fivefold.errors import SpecError, require
from fivefold.spec.checks import check_count, is_real

if TYPE_CHECKING:
    from fivefold.spec.cluster import ClusterSpec

MAX_EXPERT_IMBALANCE = 1024  # the busiest of ep ranks holds at most ep x the mean; no ep group is larger
DTYPES = ("bf16", "fp16", "fp32", "fp8")
OPTIMIZERS = ("adamw",)


@dataclass(frozen=True)
class TrainSpec:
    seq_len: int = 128  # tokens per sequence
    global_batch: int = 8  # sequences per optimizer step, over all data-parallel replicas
    dtype: str = "bf16"  # compute dtype: bf16 | fp16 (mixed precision, fp32 master) | fp32 | fp8 (FP8 GEMMs,
    #                       BF16 elsewhere, as TorchTitan's Float8 and Megatron's FP8 recipes)
    optimizer: str = "adamw"  # only AdamW for now
    expert_imbalance: float = 1.0  # MoE: tokens of the busiest rank's experts / the mean (1 = balanced)
    expert_load: float = 1.0  # MoE: tokens of the busiest expert / the mean over experts (1 = balanced; a run's
    #                           measured expert_load_max_over_mean: `fivefold report` predicts with it)
    # Packed documents: positions restart at each end-of-document token and attention stays inside each
    # document (the runtime builds the mask from document ids; the cost model is unchanged by it).
    document_mask: bool = False

    def __post_init__(self) -> None:
        check_count(self.seq_len, "train.seq_len")
        check_count(self.global_batch, "train.global_batch", what="sequences per step")
        require(isinstance(self.dtype, str) and self.dtype in DTYPES, "train.dtype", self.dtype, f"use one of {', '.join(DTYPES)}")
        require(isinstance(self.document_mask, bool), "train.document_mask", self.document_mask, "use true or false")
        require(isinstance(self.optimizer, str) and self.optimizer in OPTIMIZERS, "train.optimizer", self.optimizer,
                f"use one of {', '.join(OPTIMIZERS)}")
        require(is_real(self.expert_imbalance) and 1.0 <= self.expert_imbalance <= MAX_EXPERT_IMBALANCE,
                "train.expert_imbalance", self.expert_imbalance,
                f"must be from 1 to {MAX_EXPERT_IMBALANCE} (busiest rank's expert tokens over the mean; 1 = "
                "balanced; it cannot exceed ep, all tokens on one rank)")
        require(is_real(self.expert_load) and self.expert_load >= 1.0, "train.expert_load", self.expert_load,
                "must be 1 or more (busiest expert's tokens over the mean over experts; 1 = balanced)")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_dtype(cluster: ClusterSpec) -> str:
    """fp32 on a cluster of CPUs (no fast low-precision GEMMs there), bf16 on anything with a GPU."""
    return "fp32" if all(group.device.name == "cpu" for group in cluster.groups) else "bf16"


def train_from_dict(data: dict) -> TrainSpec:
    known = {f.name for f in dataclasses.fields(TrainSpec)}
    for key in data:
        if key not in known:
            raise SpecError(f"train.{key}", data[key], f"unknown field; known: {', '.join(sorted(known))}")
    return TrainSpec(**data)
