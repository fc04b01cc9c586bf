"""The tokenizer interface, :class:`Tokenizer`, and its two kinds: :class:`ByteTokenizer`
(the built-in byte-level one) and :class:`HfTokenizer` (a Hugging Face ``tokenizers``
tokenizer built from its ``tokenizer.json``, with the special tokens and chat template it came
with). Where their files come from is :mod:`~levanter_core.data.tokenizer.load`'s business."""

from __future__ import annotations

import abc
import hashlib
import json

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from levanter_core.data.tokenizer.files import _token_text
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
    def encode_with_offsets(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per text, its int32 ids and an int64 ``[len(ids), 2]`` array of the character
        span ``[start, end)`` of ``text`` that each token covers (``(0, 0)`` for tokens that
        cover no text, such as a BOS the tokenizer adds). Special tokens written in the
        text (``<|endoftext|>``...) are encoded as themselves, one id each.
        ``add_special_tokens=False`` leaves out the tokens the tokenizer would add around
        the text on its own (a chat template writes its own)."""

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

    @property
    def bos_token(self) -> str | None:
        """The text of the beginning-of-text token, if the tokenizer names one."""
        return None

    @property
    def bos_id(self) -> int | None:
        """The id of :attr:`bos_token`, if the tokenizer names one that its vocabulary has."""
        return None

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template that came with the tokenizer (``chat_template`` of its
        ``tokenizer_config.json``, or its ``chat_template.jinja``), if any."""
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

    def encode_with_offsets(self, texts, add_special_tokens=True):
        """Byte ids, with ``<|endoftext|>`` in the text read as the end-of-text id (as a
        Hugging Face tokenizer reads its special tokens); each byte's span is the
        character it belongs to."""
        return [self._encode_one_with_offsets(text) for text in texts]

    def _encode_one_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids, spans, char = [], [], 0
        for k, piece in enumerate(text.split(EOS_TEXT)):
            if k:
                ids.append(np.array([self.eos_id], np.int32))
                spans.append(np.array([[char, char + len(EOS_TEXT)]], np.int64))
                char += len(EOS_TEXT)
            data = np.frombuffer(piece.encode("utf-8"), dtype=np.uint8)
            starts_char = (data & 0xC0) != 0x80  # not a UTF-8 continuation byte
            char_of_byte = char + np.cumsum(starts_char, dtype=np.int64) - 1
            ids.append(data.astype(np.int32))
            spans.append(np.stack([char_of_byte, char_of_byte + 1], axis=1))
            char += len(piece)
        return np.concatenate(ids), np.concatenate(spans)

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
        printable = [
            *range(ord("!"), ord("~") + 1),
            *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), 256),
        ]
        others = [b for b in range(256) if b not in printable]
        chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
        tok = RustTokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOS_TEXT, special=True)])
        return tok.to_str()


class HfTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer loaded from its ``tokenizer.json`` (read from a
    file, or built from another format's files), with the special tokens and chat template of
    its ``tokenizer_config.json``, where given."""

    def __init__(
        self,
        name: str,
        tokenizer_json: str,
        eos_token: str | None = None,
        *,
        bos_token: str | None = None,
        chat_template: str | None = None,
        config: dict | None = None,
        added_tokens: tuple[str, ...] = (),
    ):
        self.name = name
        self._json_digest = hashlib.sha256(tokenizer_json.encode()).hexdigest()
        try:
            self._tok = RustTokenizer.from_str(tokenizer_json)
        except Exception as e:
            raise DataError(f"tokenizer {name!r}: not a valid tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
        self.eos_id = next((i for i in map(self._tok.token_to_id, candidates) if i is not None), None)
        self._bos_token = bos_token
        self._chat_template = chat_template
        self.config = dict(config or {})
        """The ``tokenizer_config.json`` it came with (with ``special_tokens_map.json``'s names
        where the former has none); {} if none."""
        self.added_tokens = added_tokens
        """Special tokens added to the files' vocabulary (``special_tokens``), in id order: the
        last ``len(added_tokens)`` ids."""

    @property
    def fingerprint(self) -> str:
        # The chat template and BOS text decide how chats are rendered into text to encode.
        extras = json.dumps([self._bos_token, self._chat_template]) if self._bos_token or self._chat_template else ""
        chat = f"-chat{hashlib.sha256(extras.encode()).hexdigest()[:16]}" if extras else ""
        return f"hf-{self._json_digest}-eos{self.eos_id}{chat}"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in self._tok.encode_batch(texts)]

    def encode_with_offsets(self, texts, add_special_tokens=True):
        out = []
        for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens):
            offsets = np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)
            out.append((np.asarray(e.ids, dtype=np.int32), offsets))
        return out

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self._tok.id_to_token(self.eos_id)

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def bos_id(self) -> int | None:
        return None if self._bos_token is None else self._tok.token_to_id(self._bos_token)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def to_tokenizer_json(self) -> str:
        return self._tok.to_str()

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` (a token of the vocabulary, written as it is stored), or None."""
        return self._tok.token_to_id(token)

    def named_special_tokens(self) -> dict[str, str]:
        """The text of each special-token role (``pad_token``, ``eos_token``, ``bos_token``,
        ``unk_token``) that this tokenizer has, as ``transformers`` would report it: named by its
        ``tokenizer_config.json`` (the end-of-text token also when found by its usual name)."""
        named = {role: _token_text(self.config.get(role)) for role in SPECIAL_TOKEN_ROLES}
        named["eos_token"] = self.eos_token
        named["bos_token"] = self.bos_token
        return {role: text for role, text in named.items() if isinstance(text, str)}

    def hf_files(self, *, chat_template: str | None = None) -> dict[str, str]:
        """This tokenizer as the files of a Hugging Face tokenizer directory (name -> text), for
        an export that ``transformers.AutoTokenizer`` loads: ``tokenizer.json``, and a
        ``tokenizer_config.json`` and ``special_tokens_map.json`` naming its special tokens (the
        ones it came with, and the added ones), with its chat template (``chat_template``, the
        one the model was trained with, in its place)."""
        config = {k: v for k, v in self.config.items() if k not in ("added_tokens_decoder", "chat_template")}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        named = self.named_special_tokens()
        config.update(named)
        extra = [_token_text(t) for t in config.get("additional_special_tokens") or []]
        extra += [t for t in self.added_tokens if t not in extra and t not in named.values()]
        if extra:
            config["additional_special_tokens"] = extra
        if chat_template or self._chat_template:
            config["chat_template"] = chat_template or self._chat_template
        special_map = {k: config[k] for k in (*SPECIAL_TOKEN_ROLES, "additional_special_tokens") if k in config}
        return {
            "tokenizer.json": self._tok.to_str(),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
            "special_tokens_map.json": json.dumps(special_map, indent=2, ensure_ascii=False) + "\n",
        }


SPECIAL_TOKEN_ROLES = ("pad_token", "eos_token", "bos_token", "unk_token")
"""The special-token roles a tokenizer may name, in the order their added tokens get ids."""
