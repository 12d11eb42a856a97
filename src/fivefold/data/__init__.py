"""Tokenizers, token datasets, and a global batch loader whose order does not depend on the plan."""

from fivefold.data.corpus import builtin_corpus
from fivefold.data.dataset import (TokenDataset, default_dataset, end_of_document_id, open_dataset, read_token_file,
                                   tokenize_documents, write_token_file, write_tokens)
from fivefold.data.blend import Blend
from fivefold.data.loader import GlobalBatchLoader
from fivefold.data.sources import open_data, open_source, write_data_caches
from fivefold.spec.datasource import parse_data_spec
from fivefold.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["Blend", "open_data", "open_source", "parse_data_spec", "write_data_caches", "ByteTokenizer", "GlobalBatchLoader", "HFTokenizer", "TokenDataset", "builtin_corpus",
           "default_dataset", "end_of_document_id", "load_tokenizer", "open_dataset", "read_token_file",
           "tokenize_documents", "write_token_file", "write_tokens"]
