"""Write a token file from a text file: `python -m fivefold.data.prepare corpus.txt corpus.bin
[--tokenizer tokenizer.json]`. The result (corpus.bin + corpus.json) is what `fivefold train --data` maps."""

from __future__ import annotations

import argparse
import sys

from fivefold.data.dataset import read_token_file, write_token_file
from fivefold.data.tokenizer import END_OF_DOCUMENT_NAMES, load_tokenizer
from fivefold.errors import FivefoldError, SpecError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fivefold.data.prepare", description=__doc__.split("`")[0])
    parser.add_argument("text", help="UTF-8 text file")
    parser.add_argument("out", help="token file to write (NAME.bin; NAME.json is written beside it)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer.json (default: bytes)")
    parser.add_argument("--document-separator", default=None,
                        help="text that separates documents (e.g. a blank line '\\n\\n'); each document is closed "
                             "by the tokenizer's end-of-document token for --document-mask (default: only the "
                             "end-of-document tokens written in the text)")
    args = parser.parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        separator = args.document_separator.encode().decode("unicode_escape") if args.document_separator else None
        if separator and tokenizer.end_of_document is None:
            raise SpecError("--document-separator", args.document_separator,
                            f"the tokenizer {tokenizer.name} has no end-of-document token "
                            f"(one of {', '.join(END_OF_DOCUMENT_NAMES)})")
        path = write_token_file(args.text, args.out, tokenizer, document_separator=separator)
        dataset = read_token_file(path)
    except FivefoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    documents = "" if dataset.end_of_document is None else \
        f", {int((dataset.tokens == dataset.end_of_document).sum()):,} end-of-document tokens"
    print(f"wrote {path}: {len(dataset):,} tokens ({dataset.tokens.dtype}, tokenizer {tokenizer.name}, "
          f"vocab {tokenizer.vocab_size}{documents})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
