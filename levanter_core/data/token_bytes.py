"""How many bytes of text each token stands for: the denominator of bits per byte.

A loss per token depends on the tokenizer (a tokenizer with longer tokens has fewer, harder
predictions); a loss per byte of text does not. :func:`token_byte_lengths` gives, for every id
of a vocabulary, the number of UTF-8 bytes its token adds to the text, so that the bytes of an
evaluation batch are a lookup and a sum on the device, next to its loss:

* byte-level tokenizers (GPT-2's byte-to-character table; Llama 3, Qwen, OLMo...): one byte
  per character of the token's string, whatever the text's script;
* SentencePiece-style vocabularies (``▁`` for a space, ``<0x0A>`` byte fallback; Llama 2,
  Mistral, Gemma): the token's text with ``▁`` as a space, and one byte per fallback token;
* WordPiece: the token without its continuation prefix (``##``); the spaces between words
  are not tokens, so they count no bytes;
* special tokens (end of text, chat markers, padding) stand for no text: 0 bytes; other added
  tokens stand for their own text.
"""

from __future__ import annotations

import json
import re

import numpy as np
from tokenizers import Tokenizer as RustTokenizer

from levanter_core.data.tokenizer import ByteTokenizer, Tokenizer

_BYTE_FALLBACK = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def token_byte_lengths(tokenizer: Tokenizer, vocab_size: int | None = None) -> np.ndarray:
    """An int32 array ``[vocab_size]``: the bytes of text each token id stands for (see the
    module docstring). ``vocab_size`` (a model's vocabulary, often padded past the tokenizer's):
    at least this long, ids the tokenizer does not have standing for no bytes."""
    lengths = _lengths(tokenizer)
    if vocab_size is not None and vocab_size > len(lengths):
        lengths = np.concatenate([lengths, np.zeros(vocab_size - len(lengths), np.int32)])
    return lengths


def _lengths(tokenizer: Tokenizer) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        lengths = np.ones(tokenizer.vocab_size, np.int32)
        lengths[tokenizer.eos_id] = 0
        return lengths
    spec = json.loads(tokenizer.to_tokenizer_json())
    rust = RustTokenizer.from_str(json.dumps(spec))
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    byte_level = _uses(spec, "ByteLevel")
    model = spec.get("model") or {}
    prefix = model.get("continuing_subword_prefix") if model.get("type") == "WordPiece" else None
    lengths = np.zeros(tokenizer.vocab_size, np.int32)
    for i in range(tokenizer.vocab_size):
        token = rust.id_to_token(i)
        if token is None or added.get(i, {}).get("special"):
            continue
        if i in added:  # added tokens are matched in the text as they are written
            lengths[i] = len(added[i]["content"].encode("utf-8"))
        elif byte_level:
            lengths[i] = len(token)  # each character of a byte-level token is one byte of text
        elif _BYTE_FALLBACK.match(token):
            lengths[i] = 1
        else:
            if prefix and token.startswith(prefix):
                token = token[len(prefix) :]
            lengths[i] = len(token.replace("\u2581", " ").encode("utf-8"))
    return lengths


def _uses(spec: dict, kind: str) -> bool:
    """Whether ``spec``'s pre-tokenizer or decoder is (or contains) one of type ``kind``."""

    def found(part) -> bool:
        if not isinstance(part, dict):
            return False
        if part.get("type") == kind:
            return True
        return any(found(p) for p in part.get("pretokenizers", []) + part.get("decoders", []))

    return found(spec.get("pre_tokenizer")) or found(spec.get("decoder"))
