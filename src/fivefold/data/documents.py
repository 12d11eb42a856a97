"""Rows of documents through the Hugging Face `datasets` library: JSON lines, Parquet, text files and
folders written by `save_to_disk`, always from local files (the hub is never asked: offline mode). Each
row's text field is tokenized with `Dataset.map` (progress bar; several processes for large data) and the
documents are packed in order, each closed by the tokenizer's end-of-document token when it has one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fivefold.data.tokenizer import Tokenizer
from fivefold.errors import SpecError

ROWS_PER_PROCESS = 20_000  # below this, a second tokenizing process costs more than it saves
BLOCKS_PER_PROCESS = 64  # ... and of 4096-line blocks of one text
PROGRESS_MIN_ROWS = 1_000  # smaller data tokenizes at once: no progress bar
PROGRESS_MIN_CHARS = 10_000_000
SUFFIXES_OF = {"json": (".jsonl", ".json"), "parquet": (".parquet",), "text": (".txt", ".text", ".md")}


def _datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, never the hub
    import datasets

    return datasets


def load_rows(source: Path, kind: str) -> Any:
    """A `datasets.Dataset` of the rows of `source`: a file or folder of `kind` (json, parquet, text) or a
    save_to_disk folder (kind 'datasets'; a DatasetDict gives its 'train' split)."""
    datasets = _datasets()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()  # only the tokenizing bar below: reading local files is quick
    try:
        return _load_rows(datasets, source, kind)
    finally:
        datasets.enable_progress_bars()


def _load_rows(datasets: Any, source: Path, kind: str) -> Any:
    if kind == "datasets":
        rows = datasets.load_from_disk(str(source))
        if isinstance(rows, datasets.DatasetDict):
            if "train" not in rows:
                raise SpecError("--data", str(source), f"the DatasetDict has no 'train' split (it has "
                                                       f"{', '.join(rows)}); save the split to train on")
            rows = rows["train"]
        return rows
    files = ([source] if source.is_file()
             else sorted(p for p in source.iterdir() if p.is_file() and p.suffix in SUFFIXES_OF[kind]))
    if all(f.stat().st_size == 0 for f in files):
        raise SpecError("--data", str(source), "is empty (no rows)")
    with tempfile.TemporaryDirectory(prefix="fivefold-datasets-") as scratch:  # datasets' Arrow copy, thrown away
        try:
            options = {"sample_by": "document"} if kind == "text" else {}
            rows = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train",
                                         cache_dir=scratch, keep_in_memory=True, **options)
        except Exception as exc:  # the json/parquet readers raise many types; the first line says what
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            raise SpecError("--data", str(source), f"not readable as {kind} rows ({first})") from None
    return rows


def tokenize_text_blocks(text: str, tokenizer: Tokenizer, name: str, num_proc: int | None = None) -> np.ndarray:
    """One text as one stream: cut into blocks of 4096 lines (a cut never splits a line, so the tokens equal
    those of the whole text for byte-level and line-respecting tokenizers), tokenized like rows but without
    end-of-document tokens."""
    lines = text.splitlines(keepends=True)
    blocks = ["".join(lines[i:i + 4096]) for i in range(0, len(lines), 4096)]
    rows = _datasets().Dataset.from_dict({"text": blocks})
    if num_proc is None:
        num_proc = max(1, min(os.cpu_count() or 1, len(blocks) // BLOCKS_PER_PROCESS))
    return tokenize_rows(rows, tokenizer, "text", name, num_proc, close_documents=False,
                         progress=len(text) >= PROGRESS_MIN_CHARS)


def tokenize_rows(rows: Any, tokenizer: Tokenizer, text_field: str, name: str,
                  num_proc: int | None = None, close_documents: bool = True,
                  progress: bool | None = None) -> np.ndarray:
    """Every row's `text_field` tokenized and packed in row order (each followed by the end-of-document token
    when the tokenizer has one and `close_documents`). `num_proc` None: one process per ROWS_PER_PROCESS rows,
    up to the cores. `progress` None: a progress bar from PROGRESS_MIN_ROWS rows on (less is done at once, and
    a refused command stays one line)."""
    field = text_field
    if field not in rows.column_names:
        raise SpecError("--text-field", text_field, f"{name} has no such column; its columns: "
                                                    f"{', '.join(rows.column_names)}")
    if len(rows) == 0:
        raise SpecError("--data", name, "is empty (no rows)")
    if num_proc is None:
        num_proc = max(1, min(os.cpu_count() or 1, len(rows) // ROWS_PER_PROCESS))
    datasets = _datasets()
    if not (len(rows) >= PROGRESS_MIN_ROWS if progress is None else progress):
        datasets.disable_progress_bars()
    try:
        encoded = _map(rows, tokenizer, field, close_documents, num_proc, name)
    finally:
        datasets.enable_progress_bars()
    column = encoded.data.column("ids")
    tokens = np.concatenate([chunk.flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks])
    if len(tokens) == 0:
        raise SpecError("--data", name, f"its {text_field!r} texts are all empty")
    return tokens.astype(np.uint32)


def _map(rows: Any, tokenizer: Tokenizer, field: str, close: bool, num_proc: int, name: str) -> Any:
    return rows.map(_encode, fn_kwargs={"tokenizer": tokenizer, "field": field, "close": close}, batched=True,
                    remove_columns=rows.column_names, keep_in_memory=True, num_proc=num_proc if num_proc > 1 else None,
                    desc=f"tokenizing {name}")


def _encode(batch: dict[str, list], tokenizer: Tokenizer, field: str, close: bool) -> dict[str, list[list[int]]]:
    texts = [text if isinstance(text, str) else "" if text is None else str(text) for text in batch[field]]
    many = getattr(tokenizer, "encode_many", None)
    ids = many(texts) if many is not None else [tokenizer.encode(t) for t in texts]
    eod = tokenizer.end_of_document if close else None
    return {"ids": [list(row) + [eod] if eod is not None else list(row) for row in ids]}
