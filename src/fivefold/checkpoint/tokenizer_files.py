"""A model's tokenizer travels with it: training checkpoints, `convert --to-hf` and `--from-hf` carry the
tokenizer's files (Hugging Face's names), and `--init-from-hf` reads text with the folder's tokenizer.

The files are copied as they are; only a tokenizer.json without a tokenizer_config.json gets a minimal one on
export (`PreTrainedTokenizerFast`, the end-of-document token as eos), so that transformers' AutoTokenizer opens
the exported folder. No torch import.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# What Hugging Face folders hold of a tokenizer (fast and slow forms); copied when present.
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt")


def tokenizer_files(source: str | Path | None) -> dict[str, Path]:
    """{name in the destination: file} of the tokenizer at `source`: a folder (its tokenizer files), a
    tokenizer.json (with the tokenizer files beside it), or a JSON file of another name (copied as
    tokenizer.json, alone); {} for None (bytes: nothing to carry)."""
    if source is None:
        return {}
    path = Path(source)
    if path.is_dir():
        return {name: path / name for name in TOKENIZER_FILES if (path / name).is_file()}
    if not path.is_file():
        return {}
    if path.name != TOKENIZER_JSON:
        return {TOKENIZER_JSON: path}
    return {name: path.parent / name for name in TOKENIZER_FILES if (path.parent / name).is_file()}


def copy_tokenizer_files(source: str | Path | None, folder: str | Path) -> list[str]:
    """Copy the tokenizer's files into `folder`; the names copied."""
    copied = []
    for name, file in tokenizer_files(source).items():
        shutil.copyfile(file, Path(folder) / name)
        copied.append(name)
    return copied


def folder_tokenizer(folder: str | Path | None) -> str | None:
    """The tokenizer.json of a model folder (Hugging Face or a fivefold checkpoint), None when it has none."""
    if folder is None:
        return None
    file = Path(folder) / TOKENIZER_JSON
    return str(file) if file.is_file() else None


def export_tokenizer(source: str | Path | None, folder: str | Path, max_length: int) -> list[str]:
    """`convert`: the tokenizer's files into the exported folder, with a tokenizer_config.json when it has none."""
    copied = copy_tokenizer_files(source, folder)
    if TOKENIZER_JSON in copied and TOKENIZER_CONFIG not in copied:
        config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length}
        eos = end_of_document_name(Path(folder) / TOKENIZER_JSON)
        if eos is not None:
            config["eos_token"] = eos
        (Path(folder) / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        copied.append(TOKENIZER_CONFIG)
    return copied


def end_of_document_name(tokenizer_json: Path) -> str | None:
    """The tokenizer's end-of-document token (data/tokenizer.py's names, looked up as HFTokenizer does), as text."""
    from tokenizers import Tokenizer

    from fivefold.data.tokenizer import END_OF_DOCUMENT_NAMES

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_json))
    except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception on malformed files: no eos then
        return None
    return next((name for name in END_OF_DOCUMENT_NAMES if tokenizer.token_to_id(name) is not None), None)
