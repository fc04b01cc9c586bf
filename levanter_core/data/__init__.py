"""The data path: sources -> tokenizer -> tokenized cache -> shuffled sequences."""

from levanter_core.data.cache import TokenCache, build_or_load_cache, load_cache
from levanter_core.data.dataset import LmData, TokenSequenceDataset, build_lm_data
from levanter_core.data.source import (
    DataSourceConfig,
    Document,
    PythonStdlibSourceConfig,
    UrlSourceConfig,
    expand_braces,
    read_documents,
)
from levanter_core.data.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataSourceConfig",
    "Document",
    "HfTokenizer",
    "LmData",
    "PythonStdlibSourceConfig",
    "TokenCache",
    "TokenSequenceDataset",
    "Tokenizer",
    "UrlSourceConfig",
    "build_lm_data",
    "build_or_load_cache",
    "expand_braces",
    "load_cache",
    "load_tokenizer",
    "read_documents",
]
