"""Tokenizers: the built-in byte-level one, and Hugging Face ``tokenizers`` files.

Both offer the same small interface (:class:`Tokenizer`): a vocabulary size, an
end-of-text id, a fingerprint that keys the tokenized cache, batch encoding to
numpy arrays and decoding.
"""

from __future__ import annotations

import abc
import hashlib
import json
import posixpath

import fsspec
import numpy as np

from levanter_core.errors import DataError

EOS_TEXT = "<|endoftext|>"

# Names that tokenizers commonly give their end-of-text token, most common first.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class Tokenizer(abc.ABC):
    """Text to token ids and back."""

    name: str
    """What the user asked for (``byte`` or a path), for messages and ledgers."""
    vocab_size: int
    eos_id: int | None
    """The end-of-text token appended after each document; None if the tokenizer has none."""

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str:
        """Changes whenever the same text could encode differently."""

    @abc.abstractmethod
    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """One int32 array of ids per text."""

    @abc.abstractmethod
    def decode(self, ids) -> str:
        """The text of a sequence of ids (special tokens written out)."""

    @abc.abstractmethod
    def to_tokenizer_json(self) -> str:
        """This tokenizer as a Hugging Face ``tokenizer.json`` (for exported models)."""

    @property
    def eos_token(self) -> str | None:
        """The text of the end-of-text token, if there is one."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, and ``<|endoftext|>`` as 256."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    @property
    def fingerprint(self) -> str:
        return "byte-v1"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        pieces = np.split(ids, np.flatnonzero(ids == self.eos_id))
        # Every piece after the first starts with the EOS id it was split at.
        texts = [bytes(p[p != self.eos_id].astype(np.uint8)).decode("utf-8", errors="replace") for p in pieces]
        return EOS_TEXT.join(texts)

    @property
    def eos_token(self) -> str:
        return EOS_TEXT

    def to_tokenizer_json(self) -> str:
        """A byte-level BPE with no merges: each byte is one token whose id is its value.
        (GPT-2's byte-to-character table turns the bytes into the characters it works on.)"""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as RustTokenizer

        printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
        others = [b for b in range(256) if b not in printable]
        chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
        tok = RustTokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOS_TEXT, special=True)])
        return tok.to_str()


class HfTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer loaded from its ``tokenizer.json``."""

    def __init__(self, name: str, tokenizer_json: str, eos_token: str | None = None):
        from tokenizers import Tokenizer as RustTokenizer

        self.name = name
        self._json_digest = hashlib.sha256(tokenizer_json.encode()).hexdigest()
        try:
            self._tok = RustTokenizer.from_str(tokenizer_json)
        except Exception as e:
            raise DataError(f"tokenizer {name!r}: not a valid tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
        self.eos_id = next((i for i in map(self._tok.token_to_id, candidates) if i is not None), None)

    @property
    def fingerprint(self) -> str:
        return f"hf-{self._json_digest}-eos{self.eos_id}"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in self._tok.encode_batch(texts)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self._tok.id_to_token(self.eos_id)

    def to_tokenizer_json(self) -> str:
        return self._tok.to_str()


def load_tokenizer(spec: str) -> Tokenizer:
    """``byte``, a ``tokenizer.json`` file, or a directory containing one (local path or
    fsspec URL). The end-of-text token is the ``eos_token`` of a ``tokenizer_config.json``
    beside it, else the first of ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>``
    that the vocabulary has."""
    if spec == "byte":
        return ByteTokenizer()
    fs, path = fsspec.core.url_to_fs(spec)
    if fs.isdir(path):
        path = posixpath.join(path, "tokenizer.json")
        if not fs.isfile(path):
            raise DataError(f"data.tokenizer: the directory {spec!r} has no tokenizer.json")
    elif not fs.isfile(path):
        raise DataError(
            f"data.tokenizer: {spec!r} is neither 'byte' nor an existing tokenizer.json file or "
            "directory containing one (tokenizers are not downloaded from the Hugging Face hub; "
            "save one locally first)"
        )
    with fs.open(path, "r", encoding="utf-8") as f:
        tokenizer_json = f.read()
    return HfTokenizer(spec, tokenizer_json, _configured_eos(fs, posixpath.dirname(path)))


def _configured_eos(fs, directory: str) -> str | None:
    config_path = posixpath.join(directory, "tokenizer_config.json")
    if not fs.isfile(config_path):
        return None
    with fs.open(config_path, "r", encoding="utf-8") as f:
        try:
            eos = json.load(f).get("eos_token")
        except (json.JSONDecodeError, AttributeError):
            return None
    return eos.get("content") if isinstance(eos, dict) else eos
