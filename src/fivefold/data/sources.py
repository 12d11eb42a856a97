"""What `--data` names: one source or a weighted blend of sources, each opened as one token stream.

    --data corpus.bin | corpus.npy           token ids, memory-mapped
    --data shards/                           a folder of .bin/.npy shards, read in name order as one stream
    --data story.txt                         UTF-8 text (also .text, .md)
    --data docs.jsonl | docs.parquet         one document per row, its --text-field (default "text")
    --data docs/                             a folder of .jsonl/.json/.parquet/.txt files (one kind)
    --data saved/                            a Hugging Face `datasets` folder written by save_to_disk
    --data 0.7:web/,0.3:code.jsonl           a blend: samples drawn from each source by weight (data/blend.py)
    --data 0.7:a.jsonl@text,0.3:b.parquet@content   each source's own text field (spec/datasource.py)

Text is tokenized once and cached beside the source (data/dataset.py cached_tokens); rows go through the
`datasets` library (data/documents.py), from local files only.
"""

from __future__ import annotations

import json
from pathlib import Path

from fivefold.data.blend import Blend
from fivefold.data.dataset import TokenDataset, cached_tokens, open_dataset, write_pending_cache
from fivefold.data.shards import SHARD_SUFFIXES, read_shard_folder
from fivefold.data.tokenizer import Tokenizer
from fivefold.errors import SpecError
from fivefold.spec.datasource import parse_data_spec

TEXT_SUFFIXES = (".txt", ".text", ".md")
ROW_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # file suffix -> datasets builder
DATASETS_FOLDER_FILES = ("state.json", "dataset_dict.json")  # what save_to_disk writes (Dataset, DatasetDict)
KINDS = ".bin/.npy tokens, .txt text, .jsonl/.json/.parquet rows, a folder of one of these, or a `datasets` " \
        "save_to_disk folder"


def folder_kind(folder: Path) -> str:
    """'datasets', 'shards', 'text', 'json' or 'parquet': what a --data folder holds."""
    if any((folder / name).is_file() for name in DATASETS_FOLDER_FILES):
        return "datasets"
    files = [p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")]
    # A .json beside a .bin of the same name is that shard's sidecar, not a data file; the token cache of a
    # file of this folder (trained on alone before) is not data either.
    files = [p for p in files if not (p.suffix == ".json" and p.with_suffix(".bin").is_file())
             and not is_token_cache(p.with_suffix(".bin"))]
    kinds = {"shards" if p.suffix in SHARD_SUFFIXES else "text" if p.suffix in TEXT_SUFFIXES
             else ROW_SUFFIXES.get(p.suffix, f"unknown ({p.suffix or p.name})") for p in files}
    if not kinds:
        raise SpecError("--data", str(folder), f"the folder is empty; give a folder of {KINDS}")
    if len(kinds) > 1:
        raise SpecError("--data", str(folder), f"the folder mixes {', '.join(sorted(kinds))} files; give a folder "
                                               "of one kind (or blend them: --data 0.5:a/,0.5:b/)")
    kind = kinds.pop()
    if kind.startswith("unknown"):
        raise SpecError("--data", str(folder), f"the folder holds {kind} files; give a folder of {KINDS}")
    return kind


def is_token_cache(path: Path) -> bool:
    """Whether NAME.bin is a token cache fivefold wrote beside a text source (its sidecar has a source_key)."""
    sidecar = path.with_suffix(".json")
    if path.suffix != ".bin" or not sidecar.is_file() or not path.is_file():
        return False
    try:
        return "source_key" in json.loads(sidecar.read_text())
    except (ValueError, OSError):
        return False


def open_source(path: str, tokenizer: Tokenizer, text_field: str = "text", min_tokens: int = 0,
                write_cache: bool = True, num_proc: int | None = None) -> TokenDataset:
    """One source as one token stream (see the module docstring)."""
    source = Path(path)
    if source.is_dir():
        kind = folder_kind(source)
        if kind == "shards":
            return read_shard_folder(source)
        cache = source.parent / f"{source.name}.{text_field}.{tokenizer.name}.bin"
        return cached_tokens(source, cache, tokenizer, lambda: tokenize_folder(source, kind, tokenizer, text_field,
                                                                               num_proc),
                             min_tokens, write_cache, text_field)
    if not source.exists():
        raise SpecError("--data", path, f"no such file or folder; give {KINDS}")
    if source.suffix in SHARD_SUFFIXES or source.suffix in TEXT_SUFFIXES:
        return open_dataset(path, tokenizer, min_tokens, write_cache)
    if source.suffix in ROW_SUFFIXES:
        cache = source.with_name(f"{source.name}.{text_field}.{tokenizer.name}.bin")
        return cached_tokens(source, cache, tokenizer, lambda: tokenize_folder(source, ROW_SUFFIXES[source.suffix],
                                                                               tokenizer, text_field, num_proc),
                             min_tokens, write_cache, text_field)
    raise SpecError("--data", path, f"unknown kind of file ({source.suffix or 'no suffix'}); give {KINDS}")


def tokenize_folder(source: Path, kind: str, tokenizer: Tokenizer, text_field: str, num_proc: int | None):
    from fivefold.data.documents import load_rows, tokenize_rows

    # A folder of text files has one column, "text" (each file one document), whatever --text-field says.
    field = "text" if kind == "text" else text_field
    return tokenize_rows(load_rows(source, kind), tokenizer, field, str(source), num_proc)


def open_data(spec: str | None, tokenizer: Tokenizer, text_field: str = "text", min_tokens: int = 0,
              write_cache: bool = True) -> TokenDataset | Blend:
    """The `--data` flag: None -> the built-in corpus; one source; or a Blend of weighted sources. A source's own
    text field (`a.jsonl@content`) wins over `text_field` (--text-field)."""
    if spec is None:
        return open_dataset(None, tokenizer)
    sources = parse_data_spec(spec)
    opened = [open_field_source(path, field, tokenizer, text_field, min_tokens, write_cache)
              for _, path, field in sources]
    if len(opened) == 1:
        return opened[0]
    return Blend(opened, [source.weight for source in sources])


def open_field_source(path: str, field: str | None, tokenizer: Tokenizer, text_field: str, min_tokens: int,
                      write_cache: bool) -> TokenDataset:
    """open_source with the source's own text field, when it names one: only rows have fields."""
    if field is None:
        return open_source(path, tokenizer, text_field, min_tokens, write_cache)
    source = Path(path)
    rows = source.suffix in ROW_SUFFIXES or (source.is_dir() and folder_kind(source) in ("json", "parquet",
                                                                                         "datasets"))
    if source.exists() and not rows:
        raise SpecError("--data", f"{path}@{field}", "only JSONL, Parquet and `datasets` rows have text fields; "
                                                    f"leave out @{field} for this source")
    try:
        return open_source(path, tokenizer, field, min_tokens, write_cache)
    except SpecError as exc:
        if exc.field != "--text-field":
            raise
        raise SpecError("--data", f"{path}@{field}", exc.fix) from None


def write_data_caches(data: TokenDataset | Blend) -> None:
    """Write the token caches of data opened with write_cache=False (once the command is sure to run)."""
    for dataset in data.sources if isinstance(data, Blend) else [data]:
        write_pending_cache(dataset)
