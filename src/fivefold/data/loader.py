"""The global batch loader: step k yields the same tokens for every rank under every plan.

Every rank builds the same loader and draws the whole global batch; the plan only decides which rows
a rank keeps (dp replica r takes a contiguous block, then splits it into micro-batches). The order is a
permutation of the dataset's windows seeded by (seed, epoch), so the position in the data is one
number, `samples_seen`, that does not depend on dp, pp or cp: a run resumed under another plan
continues with the same tokens. A blend of sources (data/blend.py) adds one count per source, and each
source has its own permutation per epoch, seeded by (seed, source, epoch).
"""

from __future__ import annotations

import numpy as np
import torch

from fivefold.data.blend import Blend, next_source
from fivefold.data.dataset import TokenDataset
from fivefold.errors import SpecError

STATE_VERSION = 1


class GlobalBatchLoader:
    """next_batch() -> LongTensor [global_batch, seq_len + 1]; inputs = [:, :-1], targets = [:, 1:]."""

    def __init__(self, dataset: TokenDataset | Blend, seq_len: int, global_batch: int, seed: int) -> None:
        self.dataset = dataset
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.sources = dataset.sources if isinstance(dataset, Blend) else [dataset]
        self.weights = dataset.weights if isinstance(dataset, Blend) else [1.0]
        self.source_windows = [source.num_windows(seq_len) for source in self.sources]
        for source, windows in zip(self.sources, self.source_windows):
            if windows < 1:
                raise SpecError("--data", source.name, f"has {len(source)} tokens; one sequence of seq_len="
                                                       f"{seq_len} needs at least {seq_len + 1}")
        self.windows = sum(self.source_windows)
        self.samples_seen = 0  # windows handed out so far, over all epochs and sources
        self.source_samples = [0] * len(self.sources)  # ... of each source
        self.steps = 0
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, permutation)

    def _order_of(self, source: int, epoch: int) -> np.ndarray:
        cached = self._orders.get(source)
        if cached is None or cached[0] != epoch:
            # One source keeps the (seed, epoch) stream it always had.
            key = [self.seed, epoch] if len(self.sources) == 1 else [self.seed, source, epoch]
            cached = (epoch, np.random.default_rng(key).permutation(self.source_windows[source]))
            self._orders[source] = cached
        return cached[1]

    def next_batch(self) -> torch.Tensor:
        rows = []
        for _ in range(self.global_batch):
            source = next_source(self.weights, self.source_samples) if len(self.sources) > 1 else 0
            epoch, offset = divmod(self.source_samples[source], self.source_windows[source])
            window = int(self._order_of(source, epoch)[offset])
            rows.append(self.sources[source].window(window, self.seq_len))
            self.source_samples[source] += 1
        self.samples_seen += self.global_batch
        self.steps += 1
        return torch.from_numpy(np.stack(rows))

    @property
    def epoch(self) -> int:
        return self.samples_seen // self.windows

    def state_dict(self) -> dict:
        """Plain ints and strings (fits a DCP train_state or JSON); nothing about the plan."""
        state = {"version": STATE_VERSION, "seed": self.seed, "seq_len": self.seq_len, "windows": self.windows,
                 "dataset": self.dataset.name, "samples_seen": self.samples_seen, "steps": self.steps}
        if len(self.sources) > 1:
            state |= {"source_windows": list(self.source_windows), "weights": list(self.weights),
                      "source_samples": list(self.source_samples)}
        return state

    def differs_from(self, state: dict) -> str | None:
        """The first key of a saved state that another seed, sequence length or data would change, or None."""
        mine = self.state_dict()
        return next((key for key in ("seed", "seq_len", "windows", "source_windows", "weights")
                     if state.get(key) != mine.get(key)), None)

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved global position. The global batch may differ (the position is counted in
        sequences); the seed, seq_len and data must be the ones the state was saved with."""
        key = self.differs_from(state)
        if key is not None:
            raise SpecError(f"loader state {key}", state.get(key),
                            f"the resumed run uses {key}={self.state_dict().get(key)}; resume with the same "
                            "seed, sequence length and data")
        self.samples_seen = int(state["samples_seen"])
        self.steps = int(state["steps"])
        self.source_samples = ([int(n) for n in state["source_samples"]] if "source_samples" in state
                               else [self.samples_seen])
