"""Write a token file from a text file: `python -m fivefold.data.prepare corpus.txt corpus.bin
[--tokenizer tokenizer.json]`. The result (corpus.bin + corpus.json) is what `fivefold train --data` maps."""

from __future__ import annotations

import argparse
import sys

from fivefold.data.dataset import read_token_file, write_token_file
from fivefold.data.tokenizer import load_tokenizer
from fivefold.errors import FivefoldError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fivefold.data.prepare", description=__doc__.split("`")[0])
    parser.add_argument("text", help="UTF-8 text file")
    parser.add_argument("out", help="token file to write (NAME.bin; NAME.json is written beside it)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer.json (default: bytes)")
    args = parser.parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        path = write_token_file(args.text, args.out, tokenizer)
        dataset = read_token_file(path)
    except FivefoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}: {len(dataset):,} tokens ({dataset.tokens.dtype}, tokenizer {tokenizer.name}, "
          f"vocab {tokenizer.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
