"""Tokenizers: the built-in byte-level one, and Hugging Face ``tokenizers`` files, local or
named by hub model id (read through the Hugging Face cache). A Wav2Vec2 CTC tokenizer (speech
models such as ``facebook/wav2vec2-base-960h``), which comes without a ``tokenizer.json``, is
rebuilt as one from its ``vocab.json``.

Both offer the same small interface (:class:`Tokenizer`): a vocabulary size, an
end-of-text id, a fingerprint that keys the tokenized cache, batch encoding to
numpy arrays (with character offsets, for formats that train on part of each
example) and decoding, and the chat template that came with the tokenizer.

The package, one job a module: :mod:`~levanter_core.data.tokenizer.base` the
:class:`Tokenizer` interface and its two kinds; :mod:`~levanter_core.data.tokenizer.special`
special tokens added through the spec (``BASE+{JSON}``); :mod:`~levanter_core.data.tokenizer.load`
finding and loading the tokenizer a spec names (local or from the hub);
:mod:`~levanter_core.data.tokenizer.ctc` the Wav2Vec2 CTC rebuild; and
:mod:`~levanter_core.data.tokenizer.files` reading the JSON and template files beside a
tokenizer. This module is the public face: every name imported from
``levanter_core.data.tokenizer``.
"""

from levanter_core.data.tokenizer.base import EOS_TEXT, SPECIAL_TOKEN_ROLES, ByteTokenizer, HfTokenizer, Tokenizer
from levanter_core.data.tokenizer.ctc import CTC_TOKENIZER_CLASS
from levanter_core.data.tokenizer.load import (
    HUB_TOKENIZER_FILES,
    check_tokenizer_available,
    find_tokenizer_json,
    load_tokenizer,
)
from levanter_core.data.tokenizer.special import (
    LEVANTER_SFT_DEFAULTS,
    add_special_tokens,
    split_tokenizer_spec,
    tokenizer_spec_with,
)

__all__ = [
    "CTC_TOKENIZER_CLASS",
    "EOS_TEXT",
    "HUB_TOKENIZER_FILES",
    "LEVANTER_SFT_DEFAULTS",
    "SPECIAL_TOKEN_ROLES",
    "ByteTokenizer",
    "HfTokenizer",
    "Tokenizer",
    "add_special_tokens",
    "check_tokenizer_available",
    "find_tokenizer_json",
    "load_tokenizer",
    "split_tokenizer_spec",
    "tokenizer_spec_with",
]
