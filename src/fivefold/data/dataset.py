"""Token datasets: one flat array of token ids, memory-mapped from disk or built from text.

Files:
- `NAME.bin`: raw little-endian token ids, with a sidecar `NAME.json` {"dtype": "uint16" | "uint32", ...}
  (no sidecar: uint16, the nanoGPT convention);
- `NAME.npy`: a 1-D integer NumPy array;
- anything else is read as UTF-8 text, tokenized once into `NAME.<tokenizer>.bin` (+ sidecar) next to it,
  and reused while the text's size and modification time are unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from fivefold.data.corpus import builtin_corpus
from fivefold.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from fivefold.errors import SpecError

TOKEN_DTYPES = ("uint16", "uint32")


class TokenDataset:
    """A flat sequence of token ids; `tokens` is an np.memmap for files, an array in memory otherwise."""

    def __init__(self, tokens: np.ndarray, name: str, vocab_size: int | None = None) -> None:
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise SpecError("--data", name, f"expected a 1-D integer token array, got {tokens.dtype} "
                                            f"with shape {tokens.shape}")
        self.tokens = tokens
        self.name = name  # the path (or "builtin") for messages and checkpoint metadata
        self.vocab_size = vocab_size  # size of the tokenizer's vocabulary when known

    def check_vocab(self, model_vocab: int) -> None:
        """Refuse a model whose embedding table is smaller than the tokenizer that made these tokens."""
        if self.vocab_size is not None and self.vocab_size > model_vocab:
            raise SpecError("model.vocab", model_vocab, f"the data {self.name} was tokenized with a vocabulary "
                                                        f"of {self.vocab_size}; use vocab >= {self.vocab_size}")

    def __len__(self) -> int:
        return len(self.tokens)

    def num_windows(self, seq_len: int) -> int:
        """Non-overlapping training windows of seq_len + 1 tokens (input plus shifted target)."""
        return (len(self.tokens) - 1) // seq_len

    def window(self, index: int, seq_len: int) -> np.ndarray:
        start = index * seq_len
        return np.asarray(self.tokens[start:start + seq_len + 1], dtype=np.int64)


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def write_tokens(tokens: np.ndarray, path: str | Path, meta: dict | None = None) -> Path:
    """Write token ids as NAME.bin + NAME.json, atomically (several ranks may prepare the same file)."""
    path = Path(path)
    dtype = "uint16" if len(tokens) == 0 or int(np.max(tokens)) < 2**16 else "uint32"
    array = np.asarray(tokens, dtype=dtype)
    sidecar = {"dtype": dtype, "tokens": int(len(array)), **(meta or {})}
    for target, write in ((path, lambda f: array.tofile(f)),
                          (_sidecar(path), lambda f: f.write(json.dumps(sidecar, indent=2).encode()))):
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        with open(partial, "wb") as handle:
            write(handle)
        os.replace(partial, target)
    return path


def tokenize_text(text: str, tokenizer: Tokenizer) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    if isinstance(tokenizer, HFTokenizer):
        # Line blocks keep memory flat and let the Rust tokenizer use its threads.
        lines = text.splitlines(keepends=True)
        blocks = ["".join(lines[i:i + 4096]) for i in range(0, len(lines), 4096)]
        return np.fromiter((t for ids in tokenizer.encode_many(blocks) for t in ids), dtype=np.uint32)
    return np.asarray(tokenizer.encode(text), dtype=np.uint32)


def write_token_file(text_path: str | Path, out_path: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Tokenize a UTF-8 text file into a token file (NAME.bin + NAME.json) that `--data` accepts."""
    tokenizer = tokenizer or ByteTokenizer()
    text_path = Path(text_path)
    try:
        text = text_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError("--data", str(text_path), "no such file") from None
    except UnicodeDecodeError as exc:
        raise SpecError("--data", str(text_path), f"not UTF-8 text ({exc.reason} at byte {exc.start}); "
                                                  "give a .bin/.npy token file instead") from None
    stat = text_path.stat()
    return write_tokens(tokenize_text(text, tokenizer), out_path,
                        {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                         "source": str(text_path), "source_size": stat.st_size,
                         "source_mtime_ns": stat.st_mtime_ns})


def read_token_file(path: str | Path) -> TokenDataset:
    """Memory-map a .bin (with its .json sidecar) or .npy token file."""
    path = Path(path)
    if not path.is_file():
        raise SpecError("--data", str(path), "no such file")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        return TokenDataset(tokens, str(path))
    meta = {}
    if _sidecar(path).is_file():
        meta = json.loads(_sidecar(path).read_text())
    dtype = meta.get("dtype", "uint16")
    if dtype not in TOKEN_DTYPES:
        raise SpecError(f"{_sidecar(path)}:dtype", dtype, f"use one of {', '.join(TOKEN_DTYPES)}")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise SpecError("--data", str(path), f"size {size} bytes is not a whole number of {dtype} tokens")
    if size == 0:
        raise SpecError("--data", str(path), "the token file is empty")
    return TokenDataset(np.memmap(path, dtype=dtype, mode="r"), str(path), meta.get("vocab_size"))


def open_dataset(path: str | None, tokenizer: Tokenizer | None = None) -> TokenDataset:
    """The `--data` flag: None -> the built-in corpus; .bin/.npy -> memory-mapped; text -> tokenized once."""
    tokenizer = tokenizer or ByteTokenizer()
    if path is None:
        return default_dataset(tokenizer)
    file = Path(path)
    if file.suffix in (".bin", ".npy"):
        return read_token_file(file)
    if not file.is_file():
        raise SpecError("--data", path, "no such file; give a .bin/.npy token file or a UTF-8 text file")
    cache = file.with_name(f"{file.name}.{tokenizer.name}.bin")
    stat = file.stat()
    meta = json.loads(_sidecar(cache).read_text()) if _sidecar(cache).is_file() and cache.is_file() else {}
    if (meta.get("source_size"), meta.get("source_mtime_ns")) != (stat.st_size, stat.st_mtime_ns):
        write_token_file(file, cache, tokenizer)
    return read_token_file(cache)


def default_dataset(tokenizer: Tokenizer | None = None) -> TokenDataset:
    """The built-in English-like corpus (~1.2 MB), tokenized in memory."""
    tokenizer = tokenizer or ByteTokenizer()
    return TokenDataset(tokenize_text(builtin_corpus(), tokenizer), "builtin", tokenizer.vocab_size)
