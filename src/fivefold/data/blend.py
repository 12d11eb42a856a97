"""A weighted blend of token sources (`--data 0.7:web/,0.3:code.jsonl`).

Which source global sample i comes from is decided greedily, as Megatron-LM's BlendedDataset does: the
source whose count of samples so far lags its weight the most, `argmax_k(w_k * (i + 1) - count_k)`. The
choice is deterministic, exact in its proportions at every prefix, and depends only on the per-source
counts, which the loader keeps beside samples_seen in its (checkpointed) state: nothing depends on the plan.
"""

from __future__ import annotations

import numpy as np

from fivefold.data.dataset import TokenDataset
from fivefold.errors import SpecError


class Blend:
    """Several TokenDatasets and their weights (normalised to sum to 1)."""

    def __init__(self, sources: list[TokenDataset], weights: list[float]) -> None:
        total = float(sum(weights))
        self.sources = sources
        self.weights = [w / total for w in weights]
        self.name = ",".join(f"{w:g}:{s.name}" for w, s in zip(weights, sources))
        known = [s.vocab_size for s in sources if s.vocab_size is not None]
        self.vocab_size = max(known) if known else None
        ends = {s.end_of_document for s in sources} - {None}
        if len(ends) > 1:
            raise SpecError("--data", self.name, f"its sources close documents with different tokens ({sorted(ends)}); "
                                                 "tokenize them with one tokenizer")
        self.end_of_document = next(iter(ends), None)

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    def check_ids(self, model_vocab: int) -> None:
        for source in self.sources:
            source.check_ids(model_vocab)

    def check_vocab(self, model_vocab: int) -> None:
        for source in self.sources:
            source.check_vocab(model_vocab)


def next_source(weights: list[float], counts: list[int]) -> int:
    """The source of the next sample, given how many each source has given so far (ties: the first)."""
    drawn = sum(counts) + 1
    lag = np.asarray(weights) * drawn - np.asarray(counts)
    return int(np.argmax(lag))
