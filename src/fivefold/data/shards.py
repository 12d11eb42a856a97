"""A folder of token shards (.bin with optional .json sidecars, or .npy), read in name order as one stream.

Each shard stays memory-mapped; `ConcatTokens` only answers slices, copying the pieces of the shards a
window spans (a hand-written class because NumPy has no lazy concatenation of memory maps).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fivefold.data.dataset import TokenDataset, read_token_file
from fivefold.errors import SpecError

SHARD_SUFFIXES = (".bin", ".npy")


class ConcatTokens:
    """Several 1-D token arrays seen as one: len, dtype, ndim and slicing, which is all TokenDataset uses."""

    ndim = 1

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.ends = np.cumsum([len(p) for p in parts])
        self.dtype = np.result_type(*[p.dtype for p in parts])

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        assert step == 1, "token windows are contiguous"
        pieces = []
        first = int(np.searchsorted(self.ends, start, side="right"))
        for part in range(first, len(self.parts)):
            begin = 0 if part == 0 else int(self.ends[part - 1])
            if begin >= stop:
                break
            pieces.append(np.asarray(self.parts[part][max(start, begin) - begin:stop - begin]))
        return np.concatenate(pieces).astype(self.dtype, copy=False) if pieces else np.zeros(0, self.dtype)

    def __eq__(self, value: object) -> np.ndarray:  # type: ignore[override]
        return np.concatenate([np.asarray(p) == value for p in self.parts])


def shard_files(folder: Path) -> list[Path]:
    """The .bin/.npy files of `folder` in name order (their .json sidecars are not shards)."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SHARD_SUFFIXES)


def read_shard_folder(folder: Path) -> TokenDataset:
    """One TokenDataset over every shard of `folder`, in name order."""
    shards = [read_token_file(path) for path in shard_files(folder)]
    if not shards:
        raise SpecError("--data", str(folder), "holds no .bin/.npy token shards")
    known_vocab = [s.vocab_size for s in shards if s.vocab_size is not None]
    ends = {s.end_of_document for s in shards}
    if len(ends - {None}) > 1:
        raise SpecError("--data", str(folder), f"its shards close documents with different tokens "
                                               f"({sorted(ends - {None})}); tokenize them with one tokenizer")
    if len(shards) == 1:
        return shards[0]
    return TokenDataset(ConcatTokens([s.tokens for s in shards]), str(folder),  # type: ignore[arg-type]
                        max(known_vocab) if known_vocab else None, next(iter(ends - {None}), None))
