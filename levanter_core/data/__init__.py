"""The data path: sources -> formats -> tokenized cache -> sequences, shuffled and mixed.

See docs/data.md for the user's view; :mod:`levanter_core.data.pipeline` wires the
pieces together for a training run.
"""

from levanter_core.data.cache import TokenCache, open_cache, read_cache
from levanter_core.data.config import DataConfig
from levanter_core.data.dataset import Batch, SequenceDataset, TrainStream, eval_batches, sequence_dataset
from levanter_core.data.formats import (
    BUILTIN_CHAT_TEMPLATE,
    ChatFormat,
    DataFormat,
    Encoded,
    SupervisedFormat,
    TextFormat,
)
from levanter_core.data.pipeline import LmData, build_caches, build_lm_data
from levanter_core.data.source import (
    DataSourceConfig,
    PythonStdlibSourceConfig,
    Record,
    UrlSourceConfig,
    expand_braces,
    read_records,
)
from levanter_core.data.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BUILTIN_CHAT_TEMPLATE",
    "Batch",
    "ByteTokenizer",
    "ChatFormat",
    "DataConfig",
    "DataFormat",
    "DataSourceConfig",
    "Encoded",
    "HfTokenizer",
    "LmData",
    "PythonStdlibSourceConfig",
    "Record",
    "SequenceDataset",
    "SupervisedFormat",
    "TextFormat",
    "TokenCache",
    "Tokenizer",
    "TrainStream",
    "UrlSourceConfig",
    "build_caches",
    "build_lm_data",
    "eval_batches",
    "expand_braces",
    "load_tokenizer",
    "open_cache",
    "read_cache",
    "read_records",
    "sequence_dataset",
]
