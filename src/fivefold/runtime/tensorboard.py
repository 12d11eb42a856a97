"""`fivefold train --tensorboard DIR`: rank 0 writes each step's scalars with torch's standard SummaryWriter,
so `tensorboard --logdir DIR` shows the run. The tags group what belongs together on one TensorBoard page."""

from __future__ import annotations

from typing import Any

# record key (runtime/train.py) -> TensorBoard tag
STEP_SCALARS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "tokens_per_s": "speed/tokens_per_s",
    "mfu": "speed/mfu",
    "step_time_s": "speed/step_time_s",
    "peak_memory_gib": "memory/peak_gib",
    "eval_loss": "eval/loss",  # on the steps that evaluate (--eval-data)
    "eval_perplexity": "eval/perplexity",
}
# per-rank lists -> one tag per rank, e.g. step_time_per_rank/rank_1
PER_RANK_SCALARS = {
    "step_time_s_per_rank": "step_time_per_rank",
    "peak_memory_gib_per_rank": "memory_per_rank",
}


def step_scalars(record: dict[str, Any]) -> dict[str, float]:
    """{tag: value} of one step's record: what TensorBoard and Weights & Biases (runtime/tracking.py) both get."""
    scalars = {tag: float(record[key]) for key, tag in STEP_SCALARS.items()
               if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool)}
    for key, prefix in PER_RANK_SCALARS.items():
        for rank, value in enumerate(record.get(key) or []):
            scalars[f"{prefix}/rank_{rank}"] = float(value)
    scalars["train/skipped"] = float(bool(record.get("skipped")))
    return scalars


class TensorBoardWriter:
    """Event files under `folder` (created when missing); one point per scalar per optimizer step."""

    def __init__(self, folder: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported only when asked for: it is slow to load

        self.writer = SummaryWriter(log_dir=folder)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for tag, value in step_scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a run stopped at any step keeps what it measured

    def close(self) -> None:
        self.writer.close()
