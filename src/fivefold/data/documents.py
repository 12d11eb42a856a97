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


def tokenize_rows(rows: Any, tokenizer: Tokenizer, text_field: str, name: str,
                  num_proc: int | None = None) -> np.ndarray:
    """Every row's `text_field` tokenized and packed in row order (each followed by the end-of-document token
    when the tokenizer has one). `num_proc` None: one process per ROWS_PER_PROCESS rows, up to the cores."""
    field = text_field
    if field not in rows.column_names:
        raise SpecError("--text-field", text_field, f"{name} has no such column; its columns: "
                                                    f"{', '.join(rows.column_names)}")
    if len(rows) == 0:
        raise SpecError("--data", name, "is empty (no rows)")
    if num_proc is None:
        num_proc = max(1, min(os.cpu_count() or 1, len(rows) // ROWS_PER_PROCESS))
    encoded = rows.map(_encode, fn_kwargs={"tokenizer": tokenizer, "field": field}, batched=True,
                       remove_columns=rows.column_names, keep_in_memory=True, num_proc=num_proc if num_proc > 1
                       else None, desc=f"tokenizing {name}")
    column = encoded.data.column("ids")
    tokens = np.concatenate([chunk.flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks])
    if len(tokens) == 0:
        raise SpecError("--data", name, f"its {text_field!r} texts are all empty")
    return tokens.astype(np.uint32)


def _encode(batch: dict[str, list], tokenizer: Tokenizer, field: str) -> dict[str, list[list[int]]]:
    texts = [text if isinstance(text, str) else "" if text is None else str(text) for text in batch[field]]
    many = getattr(tokenizer, "encode_many", None)
    ids = many(texts) if many is not None else [tokenizer.encode(t) for t in texts]
    eod = tokenizer.end_of_document
    return {"ids": [list(row) + [eod] if eod is not None else list(row) for row in ids]}
