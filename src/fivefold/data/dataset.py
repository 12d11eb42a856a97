"""Token datasets: one flat array of token ids, memory-mapped from disk or built from text.

Files:
- `NAME.bin`: raw little-endian token ids, with a sidecar `NAME.json` {"dtype": "uint16" | "uint32", ...}
  (no sidecar: uint16, the nanoGPT convention);
- `NAME.npy`: a 1-D integer NumPy array;
- anything else is read as UTF-8 text, tokenized once into `NAME.<tokenizer>.bin` (+ sidecar) next to it,
  and reused while the text's size and modification time are unchanged (`cached_tokens`, which
  data/sources.py also uses for JSONL, Parquet and `datasets` folders).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from fivefold.data.corpus import builtin_corpus, builtin_documents
from fivefold.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from fivefold.errors import SpecError

TOKEN_DTYPES = ("uint16", "uint32")


class TokenDataset:
    """A flat sequence of token ids; `tokens` is an np.memmap for files, an array in memory otherwise."""

    def __init__(self, tokens: np.ndarray, name: str, vocab_size: int | None = None,
                 end_of_document: int | None = None) -> None:
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise SpecError("--data", name, f"expected a 1-D integer token array, got {tokens.dtype} "
                                            f"with shape {tokens.shape}")
        self.tokens = tokens
        self.name = name  # the path (or "builtin") for messages and checkpoint metadata
        self.vocab_size = vocab_size  # size of the tokenizer's vocabulary when known
        self.end_of_document = end_of_document  # the id closing each packed document, when known
        self.pending_cache: tuple[Path, dict] | None = None  # (cache file, sidecar) not written yet

    def check_ids(self, model_vocab: int, chunk: int = 1 << 24) -> None:
        """Every token id is in [0, model_vocab): an id outside would index past the embedding table inside
        a worker. Scans the (memory-mapped) file in chunks, so memory stays flat for any file size."""
        low, high = 0, 0
        for start in range(0, len(self.tokens), chunk):
            block = self.tokens[start:start + chunk]
            low, high = min(low, int(block.min())), max(high, int(block.max()))
        if low < 0:
            raise SpecError("--data", self.name, f"holds a negative token id ({low}); token ids are 0 .. vocab-1")
        if high >= model_vocab:
            raise SpecError("--data", self.name, f"holds token id {high} but model.vocab={model_vocab}; use a "
                                                 f"model with vocab >= {high + 1}, or data from a smaller tokenizer")

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


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError("--data", str(path), "no such file") from None
    except UnicodeDecodeError as exc:
        raise SpecError("--data", str(path), f"not UTF-8 text ({exc.reason} at byte {exc.start}); "
                                             "give a .bin/.npy token file instead") from None


def tokenize_documents(documents: list[str] | tuple[str, ...], tokenizer: Tokenizer) -> np.ndarray:
    """Each document's tokens followed by the tokenizer's end-of-document token (packed documents)."""
    eod = tokenizer.end_of_document
    if eod is None:
        return tokenize_text("".join(documents), tokenizer)
    if isinstance(tokenizer, ByteTokenizer):
        return tokenize_text("\x00".join(documents) + "\x00", tokenizer)  # byte 0 is its end-of-document
    encoded = (tokenizer.encode_many(list(documents)) if isinstance(tokenizer, HFTokenizer)
               else [tokenizer.encode(d) for d in documents])
    return np.fromiter((t for ids in encoded for t in (*ids, eod)), dtype=np.uint32)


def write_token_file(text_path: str | Path, out_path: str | Path, tokenizer: Tokenizer | None = None,
                     min_tokens: int = 0, document_separator: str | None = None) -> Path:
    """Tokenize a UTF-8 text file into a token file (NAME.bin + NAME.json) that `--data` accepts. Fewer than
    `min_tokens` tokens is an error raised before anything is written. With a `document_separator`, the text
    is cut there into documents, each closed by the end-of-document token; without one, end-of-document
    tokens written in the text itself mark the boundaries."""
    tokenizer = tokenizer or ByteTokenizer()
    text_path = Path(text_path)
    text = read_text(text_path)
    stat = text_path.stat()
    if document_separator:
        documents = [d for d in text.split(document_separator) if d.strip()]
        tokens = tokenize_documents(documents, tokenizer)
    else:
        tokens = tokenize_text(text, tokenizer)
    if len(tokens) < min_tokens:
        raise SpecError("--data", str(text_path), f"has {len(tokens)} tokens; one sequence needs seq_len + 1 = "
                                                  f"{min_tokens}")
    return write_tokens(tokens, out_path,
                        {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                         "end_of_document": tokenizer.end_of_document,
                         "source": str(text_path), "source_size": stat.st_size,
                         "source_mtime_ns": stat.st_mtime_ns})


def _not_a_file(path: Path) -> SpecError:
    if path.is_dir():
        return SpecError("--data", str(path), "is a folder; give a token file (.bin/.npy) or a UTF-8 text file")
    return SpecError("--data", str(path), "no such file; give a .bin/.npy token file or a UTF-8 text file")


def _read_npy(path: Path) -> TokenDataset:
    """A .npy token array, memory-mapped; never unpickled (a .npy of Python objects is refused)."""
    with open(path, "rb") as handle:
        if handle.read(6) != b"\x93NUMPY":
            raise SpecError("--data", str(path), "not a .npy file (no NumPy header); give a 1-D integer .npy, or "
                                                 "a .bin token file")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        reason = str(exc).split(".")[0].strip() or type(exc).__name__
        raise SpecError("--data", str(path), f"not a NumPy array of token ids ({reason}); give a 1-D integer "
                                             ".npy, or a .bin token file") from None
    if not isinstance(tokens, np.ndarray):
        raise SpecError("--data", str(path), "not a single NumPy array (an .npz archive?); give a 1-D integer .npy")
    if tokens.size == 0:
        raise SpecError("--data", str(path), "the token array is empty")
    return TokenDataset(tokens, str(path))


def _read_sidecar(path: Path) -> dict:
    """NAME.json beside NAME.bin: {"dtype": "uint16" | "uint32", "tokens": N, "vocab_size": V, ...}."""
    sidecar = _sidecar(path)
    if not sidecar.is_file():
        return {}
    try:
        meta = json.loads(sidecar.read_text())
    except (ValueError, OSError) as exc:  # UnicodeDecodeError is a ValueError
        raise SpecError(str(sidecar), "unreadable", f"not a JSON sidecar ({str(exc).splitlines()[0][:80]}); fix it "
                                                    f"or delete it (then {path.name} is read as uint16)") from None
    if not isinstance(meta, dict):
        raise SpecError(str(sidecar), type(meta).__name__, 'must be a JSON object, e.g. {"dtype": "uint16"}')
    for key in ("tokens", "vocab_size"):
        value = meta.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise SpecError(f"{sidecar}:{key}", value, "must be a positive integer")
    return meta


def read_token_file(path: str | Path) -> TokenDataset:
    """Memory-map a .bin (with its .json sidecar) or .npy token file."""
    path = Path(path)
    if not path.is_file():
        raise _not_a_file(path)
    if path.suffix == ".npy":
        return _read_npy(path)
    meta = _read_sidecar(path)
    dtype = meta.get("dtype", "uint16")
    if not isinstance(dtype, str) or dtype not in TOKEN_DTYPES:
        raise SpecError(f"{_sidecar(path)}:dtype", dtype, f"use one of {', '.join(TOKEN_DTYPES)}")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise SpecError("--data", str(path), f"size {size} bytes is not a whole number of {dtype} tokens")
    if size == 0:
        raise SpecError("--data", str(path), "the token file is empty")
    if meta.get("tokens") is not None and meta["tokens"] != size // itemsize:
        raise SpecError(f"{_sidecar(path)}:tokens", meta["tokens"], f"but {path.name} holds {size // itemsize} "
                                                                  f"{dtype} tokens; the files do not belong together")
    return TokenDataset(np.memmap(path, dtype=dtype, mode="r"), str(path), meta.get("vocab_size"),
                        meta.get("end_of_document"))


def source_key(source: Path, text_field: str | None = None) -> str:
    """What a tokenized cache is keyed by besides the tokenizer: the name, size and modification time of the
    source file, or of every file under a source folder, and the text field read."""
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    digest = hashlib.sha256(str(text_field).encode())
    for file in files:
        stat = file.stat()
        digest.update(f"{file.relative_to(source) if source.is_dir() else file.name}:{stat.st_size}:"
                      f"{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def cached_tokens(source: Path, cache: Path, tokenizer: Tokenizer, tokenize: Callable[[], np.ndarray],
                  min_tokens: int = 0, write_cache: bool = True, text_field: str | None = None) -> TokenDataset:
    """The tokens of `source` from `cache` (NAME.bin + NAME.json beside it) while its key (source_key) still
    matches, else `tokenize()` once. With write_cache False nothing is written: the dataset is in memory and
    `write_pending_cache` writes it later (after every check of the command has passed)."""
    key = source_key(source, text_field)
    meta = json.loads(_sidecar(cache).read_text()) if _sidecar(cache).is_file() and cache.is_file() else {}
    if meta.get("source_key") == key:
        return read_token_file(cache)
    tokens = tokenize()
    if len(tokens) < min_tokens:
        raise SpecError("--data", str(source), f"has {len(tokens)} tokens; one sequence needs seq_len + 1 = "
                                               f"{min_tokens}")
    meta = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
            "end_of_document": tokenizer.end_of_document, "source": str(source), "source_key": key,
            **({"text_field": text_field} if text_field else {})}
    if write_cache:
        return read_token_file(write_tokens(tokens, cache, meta))
    dataset = TokenDataset(tokens, str(cache), tokenizer.vocab_size, tokenizer.end_of_document)
    dataset.pending_cache = (cache, meta)
    return dataset


def write_pending_cache(dataset: TokenDataset) -> None:
    """Write the cache of a dataset tokenized with write_cache=False (no-op for any other dataset)."""
    if dataset.pending_cache is not None:
        cache, meta = dataset.pending_cache
        write_tokens(np.asarray(dataset.tokens), cache, meta)
        dataset.pending_cache = None


def open_dataset(path: str | None, tokenizer: Tokenizer | None = None, min_tokens: int = 0,
                 write_cache: bool = True) -> TokenDataset:
    """One file: None -> the built-in corpus; .bin/.npy -> memory-mapped; text -> tokenized once (and the
    cache beside it written only when it holds at least `min_tokens`). Folders, JSONL, Parquet, `datasets`
    folders and blends: data/sources.py."""
    tokenizer = tokenizer or ByteTokenizer()
    if path is None:
        return default_dataset(tokenizer)
    file = Path(path)
    if file.suffix in (".bin", ".npy"):
        return read_token_file(file)
    if not file.is_file():
        raise _not_a_file(file)
    def tokenize() -> np.ndarray:
        from fivefold.data.documents import tokenize_text_blocks  # `datasets`: progress bar, processes

        return tokenize_text_blocks(read_text(file), tokenizer, str(file))

    return cached_tokens(file, file.with_name(f"{file.name}.{tokenizer.name}.bin"), tokenizer, tokenize, min_tokens,
                         write_cache)


def default_dataset(tokenizer: Tokenizer | None = None) -> TokenDataset:
    """The built-in English-like corpus (~1.2 MB), tokenized in memory: each story a document closed by
    the tokenizer's end-of-document token (when it has one)."""
    tokenizer = tokenizer or ByteTokenizer()
    if tokenizer.end_of_document is None:
        return TokenDataset(tokenize_text(builtin_corpus(), tokenizer), "builtin", tokenizer.vocab_size)
    tokens = tokenize_documents([story + "\n" for story in builtin_documents()], tokenizer)
    return TokenDataset(tokens, "builtin", tokenizer.vocab_size, tokenizer.end_of_document)


def end_of_document_id(dataset: TokenDataset, tokenizer: Tokenizer) -> int | None:
    """The id that closes a document in `dataset`: the one its token file records, else the tokenizer's."""
    return dataset.end_of_document if dataset.end_of_document is not None else tokenizer.end_of_document
