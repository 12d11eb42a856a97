"""Tokenizers, token datasets, and a global batch loader whose order does not depend on the plan."""

from fivefold.data.corpus import builtin_corpus
from fivefold.data.dataset import (TokenDataset, default_dataset, end_of_document_id, open_dataset, read_token_file,
                                   tokenize_documents, write_token_file, write_tokens)
from fivefold.data.loader import GlobalBatchLoader
from fivefold.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "GlobalBatchLoader", "HFTokenizer", "TokenDataset", "builtin_corpus",
           "default_dataset", "end_of_document_id", "load_tokenizer", "open_dataset", "read_token_file",
           "tokenize_documents", "write_token_file", "write_tokens"]
