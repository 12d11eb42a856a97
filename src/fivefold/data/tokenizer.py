"""Tokenizers: bytes by default (vocab 256, nothing to download), or a Hugging Face tokenizer.json."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

from fivefold.errors import SpecError


# Names of end-of-document tokens, in the order they are looked for in a tokenizer.json (GPT-2/Qwen, Llama 3,
# Llama 2/Mistral, Gemma). Llama 3's <|eot_id|> ends a chat turn, not a document, so it is not here.
END_OF_DOCUMENT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class Tokenizer(Protocol):
    vocab_size: int
    name: str  # identifies the tokenizer in cache file names and sidecars
    end_of_document: int | None  # the id that closes a packed document; None = the tokenizer has none

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: every text round-trips, and any model with vocab >= 256 can read it."""

    vocab_size = 256
    name = "byte"
    # UTF-8 text never contains the NUL byte, so byte 0 can close a document without colliding with text.
    end_of_document = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer.json (what Hugging Face models ship)."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise SpecError("--tokenizer", str(path), "reading tokenizer.json needs the `tokenizers` package "
                                                      "(pip install tokenizers)") from None
        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise SpecError("--tokenizer", str(path), f"not a readable tokenizer.json ({exc})") from None
        self.path = path
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.name = "hf-" + hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        self.end_of_document = next((self._tokenizer.token_to_id(n) for n in END_OF_DOCUMENT_NAMES
                                     if self._tokenizer.token_to_id(n) is not None), None)

    def encode(self, text: str) -> list[int]:
        # No special tokens added: a corpus is one long stream; an end-of-document token written in the text
        # (e.g. "<|endoftext|>") is still recognised, which is how text files mark document boundaries.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


def load_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """None -> ByteTokenizer; a tokenizer.json (or a folder holding one) -> HFTokenizer."""
    if path is None:
        return ByteTokenizer()
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise SpecError("--tokenizer", path, "no such file; give a Hugging Face tokenizer.json or a folder "
                                             "holding one (or leave it out for bytes)")
    return HFTokenizer(file)
