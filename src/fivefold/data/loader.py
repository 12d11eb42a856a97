"""The global batch loader: step k yields the same tokens for every rank under every plan.

Every rank builds the same loader and draws the whole global batch; the plan only decides which rows
a rank keeps (dp replica r takes a contiguous block, then splits it into micro-batches). The order is a
permutation of the dataset's windows seeded by (seed, epoch), so the position in the data is one
number, `samples_seen`, that does not depend on dp, pp or cp: a run resumed under another plan
continues with the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from fivefold.data.dataset import TokenDataset
from fivefold.errors import SpecError

STATE_VERSION = 1


class GlobalBatchLoader:
    """next_batch() -> LongTensor [global_batch, seq_len + 1]; inputs = [:, :-1], targets = [:, 1:]."""

    def __init__(self, dataset: TokenDataset, seq_len: int, global_batch: int, seed: int) -> None:
        self.dataset = dataset
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.windows = dataset.num_windows(seq_len)
        if self.windows < 1:
            raise SpecError("--data", dataset.name, f"has {len(dataset)} tokens; one sequence of seq_len="
                                                    f"{seq_len} needs at least {seq_len + 1}")
        self.samples_seen = 0  # windows handed out so far, over all epochs
        self.steps = 0
        self._epoch = -1
        self._order: np.ndarray | None = None

    def _order_of(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._epoch = epoch
        return self._order

    def next_batch(self) -> torch.Tensor:
        rows = []
        for sample in range(self.samples_seen, self.samples_seen + self.global_batch):
            epoch, offset = divmod(sample, self.windows)
            rows.append(self.dataset.window(int(self._order_of(epoch)[offset]), self.seq_len))
        self.samples_seen += self.global_batch
        self.steps += 1
        return torch.from_numpy(np.stack(rows))

    @property
    def epoch(self) -> int:
        return self.samples_seen // self.windows

    def state_dict(self) -> dict:
        """Plain ints and strings (fits a DCP train_state or JSON); nothing about the plan."""
        return {"version": STATE_VERSION, "seed": self.seed, "seq_len": self.seq_len, "windows": self.windows,
                "dataset": self.dataset.name, "samples_seen": self.samples_seen, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved global position. The global batch may differ (the position is counted in
        sequences); the seed, seq_len and data must be the ones the state was saved with."""
        for key in ("seed", "seq_len", "windows"):
            if state.get(key) != getattr(self, key):
                raise SpecError(f"loader state {key}", state.get(key),
                                f"the resumed run uses {key}={getattr(self, key)}; resume with the same "
                                "seed, sequence length and data")
        self.samples_seen = int(state["samples_seen"])
        self.steps = int(state["steps"])
