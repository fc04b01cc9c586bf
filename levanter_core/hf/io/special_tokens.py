"""The special token ids (``pad_token_id``, ``bos_token_id``, ``eos_token_id``) an export writes
into its ``config.json``: those of the tokenizer files it ships, never one outside the
vocabulary."""

from __future__ import annotations

import json
import logging
import os

from tokenizers import Tokenizer as RustTokenizer

from levanter_core.data.tokenizer import load_tokenizer

# the name its log lines had before the split from levanter_core.hf.bridge (the CLI prints it)
logger = logging.getLogger("levanter_core.hf.bridge")

SPECIAL_TOKENS = {"pad_token_id": "pad_token", "bos_token_id": "bos_token", "eos_token_id": "eos_token"}
"""The ``config.json`` keys of the special token ids, and the ``tokenizer_config.json`` keys
that name those tokens."""


def _special_token_ids(directory: str, hf_config: dict, vocab_size: int) -> dict[str, int | list[int] | None]:
    """The special token ids for the ``config.json`` of an export in ``directory``: those of
    the tokenizer written there, else those of ``hf_config`` (an imported model's), else None,
    written explicitly so that ``transformers`` does not fall back to its family's defaults
    (GPT-2's 50256, say), which need not exist in this vocabulary. An id outside
    ``0 .. vocab_size - 1`` is never written."""
    from_tokenizer = _tokenizer_special_ids(directory)
    ids = {}
    for key in SPECIAL_TOKENS:
        ours, theirs = from_tokenizer.get(key), hf_config.get(key)
        # keep an imported list of end ids (chat models stop on several) when it has ours
        value = theirs if ours is None or (isinstance(theirs, list) and ours in theirs) else ours
        if value is not None and not in_vocabulary(value, vocab_size):
            logger.warning("not writing %s %s: the vocabulary has %d tokens", key, value, vocab_size)
            value = None
        ids[key] = value
    return ids


def in_vocabulary(value, vocab_size: int) -> bool:
    """Whether ``value`` (a token id, or a list of them) names tokens of a ``vocab_size``-token vocabulary."""
    values = value if isinstance(value, list) else [value]
    return all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in values)


def _tokenizer_special_ids(directory: str) -> dict[str, int]:
    """The ids of the special tokens that the tokenizer files in ``directory`` define (its
    ``tokenizer_config.json`` or ``special_tokens_map.json`` names them; the end-of-text token
    is found as training found it, see :func:`levanter_core.data.tokenizer.load_tokenizer`)."""
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return {}
    vocabulary = RustTokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    named = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = os.path.join(directory, file)
        if os.path.isfile(path):
            with open(path) as f:
                contents = json.load(f)
            if isinstance(contents, dict):
                named.update({k: contents[k] for k in SPECIAL_TOKENS.values() if contents.get(k) is not None})
    ids: dict[str, int] = {}
    for key, name in SPECIAL_TOKENS.items():
        token = named.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        token_id = vocabulary.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            ids[key] = token_id
    eos = load_tokenizer(directory).eos_id
    if eos is not None:
        ids["eos_token_id"] = eos
    return ids
