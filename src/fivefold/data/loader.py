"""The global batch loader: step k yields the same tokens for every rank under every plan.

Every rank builds the same loader and draws the whole global batch; the plan only decides which rows
a rank keeps (dp replica r takes a contiguous block, then splits it into micro-batches). The order is a
permutation of the dataset's windows seeded by (seed, epoch), so the position in the data is one
number, `samples_seen`, that does not depend on dp, pp or cp: a run resumed under another plan
continues with the same tokens. A blend of sources (data/blend.py) adds one count per source, and each
source has its own permutation per epoch, seeded by (seed, source, epoch). A resume with --data-change allow
keeps the position of each source read before and starts the others anew (continue_changed).
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
        self.source_samples = [0] * len(self.sources)  # ... of each source: its position in its own order
        self.blend_counts = [0] * len(self.sources)  # samples per source since the blend began (the weight rule)
        # What seeds each source's window order besides (seed, epoch): nothing for one source (the stream it
        # always had), its index in a blend; a source that joined at a --data-change keeps a key of its own.
        self.order_keys: list[list[int]] = [[]] if len(self.sources) == 1 else [[i] for i in range(len(self.sources))]
        self.data_changes = 0  # resumes that changed the data (--data-change allow)
        self.steps = 0
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, permutation)

    def _order_of(self, source: int, epoch: int) -> np.ndarray:
        cached = self._orders.get(source)
        if cached is None or cached[0] != epoch:
            key = [self.seed, *self.order_keys[source], epoch]
            cached = (epoch, np.random.default_rng(key).permutation(self.source_windows[source]))
            self._orders[source] = cached
        return cached[1]

    def next_batch(self) -> torch.Tensor:
        rows = []
        for _ in range(self.global_batch):
            source = next_source(self.weights, self.blend_counts) if len(self.sources) > 1 else 0
            epoch, offset = divmod(self.source_samples[source], self.source_windows[source])
            window = int(self._order_of(source, epoch)[offset])
            rows.append(self.sources[source].window(window, self.seq_len))
            self.source_samples[source] += 1
            self.blend_counts[source] += 1
        self.samples_seen += self.global_batch
        self.steps += 1
        return torch.from_numpy(np.stack(rows))

    @property
    def epoch(self) -> int:
        return self.samples_seen // self.windows

    def state_dict(self) -> dict:
        """Plain ints and strings (fits a DCP train_state or JSON); nothing about the plan."""
        state = {"version": STATE_VERSION, "seed": self.seed, "seq_len": self.seq_len, "windows": self.windows,
                 "dataset": self.dataset.name, "samples_seen": self.samples_seen, "steps": self.steps,
                 "source_names": [source.name for source in self.sources]}
        if len(self.sources) > 1:
            state |= {"source_windows": list(self.source_windows), "weights": list(self.weights),
                      "source_samples": list(self.source_samples)}
        if self.blend_counts != self.source_samples:
            state["blend_counts"] = list(self.blend_counts)
        if self.data_changes:
            state |= {"data_changes": self.data_changes, "order_keys": [list(k) for k in self.order_keys],
                      "source_samples": list(self.source_samples)}
        return state

    def differs_from(self, state: dict) -> str | None:
        """The first key of a saved state that another seed, sequence length or data would change, or None."""
        mine = self.state_dict()
        return next((key for key in ("seed", "seq_len", "windows", "source_windows", "weights")
                     if state.get(key) != mine.get(key)), None)

    def load_state_dict(self, state: dict, allow_change: bool = False) -> None:
        """Continue at the saved global position. The global batch may differ (the position is counted in
        sequences); the seed, seq_len and data must be the ones the state was saved with, unless
        `allow_change` (--data-change allow) lets the data differ (continue_changed)."""
        key = self.differs_from(state)
        if key is not None and not (allow_change and key not in ("seed", "seq_len")):
            raise SpecError(f"loader state {key}", state.get(key),
                            f"the resumed run uses {key}={self.state_dict().get(key)}; resume with the same "
                            "seed, sequence length and data")
        self.samples_seen = int(state["samples_seen"])
        self.steps = int(state["steps"])
        self._orders.clear()
        if key is not None:
            self.continue_changed(state)
            return
        self.source_samples = ([int(n) for n in state["source_samples"]] if "source_samples" in state
                               else [self.samples_seen])
        self.blend_counts = [int(n) for n in state.get("blend_counts", self.source_samples)]
        self.order_keys = [list(k) for k in state.get("order_keys", self.order_keys)]
        self.data_changes = int(state.get("data_changes", 0))

    def continue_changed(self, state: dict) -> None:
        """--data-change allow: the global position (step, schedule) continues; a source the checkpoint read
        too, with the same name and windows, continues where it was in its own order; any other source starts
        at its beginning, with an order of its own; the blend's weights hold exactly from here on."""
        self.data_changes = int(state.get("data_changes", 0)) + 1
        saved = saved_sources(state)
        self.blend_counts = [0] * len(self.sources)
        for index, (source, windows) in enumerate(zip(self.sources, self.source_windows)):
            match = saved.get((source.name, windows))
            if match is not None:
                self.source_samples[index], self.order_keys[index] = match
            else:
                self.source_samples[index], self.order_keys[index] = 0, [index, self.data_changes]

    def describe_change(self, state: dict) -> str:
        """The line a resume with --data-change allow prints: what continues, what starts again."""
        saved = saved_sources(state)
        kept = [s.name for s, w in zip(self.sources, self.source_windows) if (s.name, w) in saved]
        names = {name for name, _ in saved}
        fresh = [f"{s.name} ({'its tokens changed' if s.name in names else 'new'})"
                 for s, w in zip(self.sources, self.source_windows) if (s.name, w) not in saved]
        dropped = sorted(names - {s.name for s in self.sources})
        return (f"--data-change allow: the data differs from the checkpoint's; the run continues at sample "
                f"{state['samples_seen']} (step {state['steps']}, the same schedule), with this blend's weights "
                f"from here on; continuing where they were: {', '.join(kept) or 'none'}; starting at their "
                f"beginning: {', '.join(fresh) or 'none'}" + (f"; no longer read: {', '.join(dropped)}"
                                                              if dropped else ""))


def saved_sources(state: dict) -> dict[tuple[str, int], tuple[int, list[int]]]:
    """(name, windows) -> (position, order key) of each source a saved loader state read. States written before
    they named their sources name them from the blend's name ("0.7:a,0.3:b")."""
    windows = state.get("source_windows") or [state["windows"]]
    names = state.get("source_names")
    if names is None:
        names = ([item.partition(":")[2] for item in str(state["dataset"]).split(",")] if len(windows) > 1
                 else [state["dataset"]])
    positions = state.get("source_samples") or [state["samples_seen"]]
    keys = state.get("order_keys") or ([[]] if len(windows) == 1 else [[i] for i in range(len(windows))])
    return {(name, int(count)): (int(position), list(key))
            for name, count, position, key in zip(names, windows, positions, keys)}
