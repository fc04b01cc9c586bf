"""Tokenizers: the built-in byte-level one, and Hugging Face ``tokenizers`` files, local or
named by hub model id (read through the Hugging Face cache). A Wav2Vec2 CTC tokenizer (speech
models such as ``facebook/wav2vec2-base-960h``), which comes without a ``tokenizer.json``, is
rebuilt as one from its ``vocab.json``.

Both offer the same small interface (:class:`Tokenizer`): a vocabulary size, an
end-of-text id, a fingerprint that keys the tokenized cache, batch encoding to
numpy arrays (with character offsets, for formats that train on part of each
example) and decoding, and the chat template that came with the tokenizer.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import posixpath
import sys

import fsspec
import numpy as np

from levanter_core.errors import DataError
from levanter_core.fileio import filesystem

EOS_TEXT = "<|endoftext|>"

# Names that tokenizers commonly give their end-of-text token, most common first.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")

HUB_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "vocab.json",
    "special_tokens_map.json",
)
"""The files of a hub model that make its tokenizer (all that is fetched of it): first the two
that messages tell people to download, then the chat template, then what a Wav2Vec2 CTC
tokenizer has in place of a ``tokenizer.json``."""

CTC_TOKENIZER_CLASS = "Wav2Vec2CTCTokenizer"
"""The ``tokenizer_class`` of a ``tokenizer_config.json`` whose ``vocab.json`` we rebuild as a
``tokenizer.json`` (the one slow-only tokenizer we read)."""


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
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as RustTokenizer

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

LEVANTER_SFT_DEFAULTS = {"pad_token": "[PAD]", "eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>"}
"""What Levanter's ``sft`` and ``sft_mixture`` give a tokenizer that lacks a role."""

_ADDED = "+{"


def split_tokenizer_spec(spec: str) -> tuple[str, dict]:
    """The tokenizer a spec names and the special tokens added to it: ``BASE+{JSON}`` (as
    :func:`tokenizer_spec_with` writes it) gives ``BASE`` and the JSON object; any other spec,
    itself and {}."""
    at = spec.find(_ADDED)
    if at < 0 or not spec.endswith("}"):
        return spec, {}
    try:
        recipe = json.loads(spec[at + 1 :])
    except json.JSONDecodeError as e:
        raise DataError(
            f"data.tokenizer {spec!r}: the added special tokens after '+' are not a JSON object ({e})"
        ) from None
    problem = _recipe_problem(recipe)
    if problem:
        raise DataError(f"data.tokenizer {spec!r}: {problem}")
    return spec[:at], recipe


def tokenizer_spec_with(spec: str, recipe: dict) -> str:
    """The spec of tokenizer ``spec`` with the special tokens of ``recipe`` added: role names
    (``pad_token``...) -> token text, ``additional_special_tokens`` -> texts, and
    ``add_missing_defaults`` (Levanter's sft: :data:`LEVANTER_SFT_DEFAULTS` for the roles the
    tokenizer lacks). Written into ``data.tokenizer`` so that every reader of the run's tokenizer
    (the cache workers, exports, sampling from a checkpoint) gets the same tokens, and the cache is
    keyed by them. Additions already in ``spec`` are kept; a role given two texts is an error."""
    base, merged = split_tokenizer_spec(spec)
    merged = dict(merged)
    for key, value in recipe.items():
        if not value:
            continue
        if key == "additional_special_tokens":
            merged[key] = list(dict.fromkeys([*merged.get(key, []), *value]))
        elif key in merged and merged[key] != value:
            raise DataError(f"data.tokenizer {spec!r} already sets {key} to {merged[key]!r}, not {value!r}")
        else:
            merged[key] = value
    problem = _recipe_problem(merged)
    if problem:
        raise DataError(problem)
    return f"{base}+{json.dumps(merged, sort_keys=True, ensure_ascii=False)}" if merged else base


def _recipe_problem(recipe) -> str | None:
    if not isinstance(recipe, dict):
        return "the added special tokens must be a JSON object"
    for key, value in recipe.items():
        if key in SPECIAL_TOKEN_ROLES:
            ok = isinstance(value, str) and value
        elif key == "additional_special_tokens":
            ok = isinstance(value, list) and all(isinstance(t, str) and t for t in value)
        elif key == "add_missing_defaults":
            ok = isinstance(value, bool)
        else:
            return f"unknown key {key!r} among the added special tokens"
        if not ok:
            return f"{key} of the added special tokens has the wrong type: {value!r}"
    return None


def add_special_tokens(base: Tokenizer, recipe: dict, name: str) -> HfTokenizer:
    """``base`` with the special tokens of ``recipe`` (see :func:`tokenizer_spec_with`), as
    ``transformers``' ``add_special_tokens`` adds them: each text missing from the vocabulary gets
    the next id (roles in the order of :data:`SPECIAL_TOKEN_ROLES`, then the additional tokens),
    matched whole in text and never split; one already there is only marked special. A role given
    a token becomes that token (``eos_token`` is then the end of text)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RustTokenizer

    if isinstance(base, ByteTokenizer):
        base = HfTokenizer(base.name, base.to_tokenizer_json(), EOS_TEXT)
    assert isinstance(base, HfTokenizer)
    named = base.named_special_tokens()
    roles = {role: recipe[role] for role in SPECIAL_TOKEN_ROLES if recipe.get(role)}
    if recipe.get("add_missing_defaults"):
        for role, default in LEVANTER_SFT_DEFAULTS.items():
            if role not in named and role not in roles:
                roles[role] = default
    wanted = list(
        dict.fromkeys(
            [*(roles[r] for r in SPECIAL_TOKEN_ROLES if r in roles), *recipe.get("additional_special_tokens", [])]
        )
    )
    tok = RustTokenizer.from_str(base.to_tokenizer_json())
    new = [t for t in wanted if tok.token_to_id(t) is None]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in wanted])
    config = {**base.config, **roles}
    if recipe.get("additional_special_tokens"):
        known = [_token_text(t) for t in config.get("additional_special_tokens") or []]
        config["additional_special_tokens"] = list(dict.fromkeys([*known, *recipe["additional_special_tokens"]]))
    return HfTokenizer(
        name,
        tok.to_str(),
        roles.get("eos_token") or base.eos_token,
        bos_token=roles.get("bos_token") or base.bos_token,
        chat_template=base.chat_template,
        config=config,
        added_tokens=(*base.added_tokens, *new),
    )


def load_tokenizer(spec: str) -> Tokenizer:
    """``byte``, a ``tokenizer.json`` file, a directory containing one (local path or fsspec
    URL), or the name of a Hugging Face hub model (``gpt2``, ``meta-llama/Llama-2-7b-hf``)
    that is not a local path: its tokenizer files are read from the Hugging Face cache,
    downloaded into it first when the hub is reachable and ``HF_HUB_OFFLINE`` is not set.

    The end-of-text token is the ``eos_token`` of a ``tokenizer_config.json`` beside the
    ``tokenizer.json``, else the first of ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``,
    ``<eos>`` that the vocabulary has. The same file gives the ``bos_token`` and
    ``chat_template`` (a ``chat_template.jinja`` beside it is used when the file has none).

    A directory (or hub model) with no ``tokenizer.json`` but a ``vocab.json`` and a
    ``tokenizer_config.json`` naming ``Wav2Vec2CTCTokenizer`` is read as that tokenizer: its
    special tokens from ``tokenizer_config.json`` and ``special_tokens_map.json``, its
    vocabulary rebuilt as a ``tokenizer.json`` that encodes as ``transformers`` does.

    ``BASE+{JSON}`` (see :func:`tokenizer_spec_with`) is tokenizer ``BASE`` with special tokens
    added."""
    base, recipe = split_tokenizer_spec(spec)
    if recipe:
        return add_special_tokens(load_tokenizer(base), recipe, spec)
    if spec == "byte":
        return ByteTokenizer()
    fs, path = _find_tokenizer(spec)
    if fs.isdir(path):  # a Wav2Vec2 CTC tokenizer's directory
        return _load_ctc_tokenizer(spec, fs, path)
    with fs.open(path, "r", encoding="utf-8") as f:
        tokenizer_json = f.read()
    directory = posixpath.dirname(path)
    config = _tokenizer_config(fs, directory)
    # special tokens named only in special_tokens_map.json (older exports) count too
    named = _read_json_object(fs, posixpath.join(directory, "special_tokens_map.json"), missing_ok=True)
    config = {**{k: v for k, v in named.items() if k in SPECIAL_TOKEN_ROLES}, **config}
    return HfTokenizer(
        spec,
        tokenizer_json,
        _token_text(config.get("eos_token")),
        bos_token=_token_text(config.get("bos_token")),
        chat_template=_chat_template(fs, directory, config),
        config=config,
    )


def check_tokenizer_available(spec: str) -> None:
    """Raise :class:`DataError` (exit status 2) unless :func:`load_tokenizer` will find the
    files of tokenizer ``spec``, so that a missing tokenizer stops a run before it reads data
    or touches a device. A hub name missing from the Hugging Face cache is downloaded into it
    here when the hub is reachable; offline, the error says how to get it there."""
    spec = split_tokenizer_spec(spec)[0]
    if spec != "byte":
        _find_tokenizer(spec)


def find_tokenizer_json(spec: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of the ``tokenizer.json`` that ``spec`` (not ``byte``) names;
    for a hub name, in the Hugging Face cache's snapshot directory, beside the model's
    ``tokenizer_config.json``. Raises :class:`DataError` saying what to do if there is none
    (also for a Wav2Vec2 CTC tokenizer, which has none: :func:`load_tokenizer` rebuilds it)."""
    fs, path = _find_tokenizer(spec)
    if fs.isdir(path):
        raise DataError(
            f"data.tokenizer: {spec!r} is a {CTC_TOKENIZER_CLASS} (vocab.json, no tokenizer.json; looked in {path})"
        )
    return fs, path


def _find_tokenizer(spec: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of what defines tokenizer ``spec`` (not ``byte``): its
    ``tokenizer.json`` file, or the directory of a Wav2Vec2 CTC tokenizer (which has none).
    Raises :class:`DataError` saying what to do if there is neither."""
    fs, path = filesystem(spec)
    from_hub = not fs.exists(path) and _is_hub_name(spec)
    if from_hub:
        fs, path = fsspec.filesystem("file"), _hub_snapshot(spec)
    if fs.isdir(path):
        json_path = posixpath.join(path, "tokenizer.json")
        if fs.isfile(json_path):
            return fs, json_path
        if _is_ctc_tokenizer(fs, path):
            return fs, path
        if from_hub:
            raise DataError(
                f"data.tokenizer: the Hugging Face hub model {spec!r} has no tokenizer.json (looked in {path}). "
                f"Download it with `hf download {spec} {' '.join(HUB_TOKENIZER_FILES[:2])}`; if the model has "
                "only a slow tokenizer (vocab.json and merges.txt, or tokenizer.model), convert it with "
                f"transformers (AutoTokenizer.from_pretrained({spec!r}).save_pretrained(DIR)) and set "
                "data.tokenizer to DIR"
            )
        raise DataError(
            f"data.tokenizer: the directory {spec!r} has no tokenizer.json (nor the vocab.json and "
            f"tokenizer_config.json of a {CTC_TOKENIZER_CLASS})"
        )
    if fs.isfile(path):
        return fs, path
    raise DataError(
        f"data.tokenizer: {spec!r} is neither 'byte', an existing tokenizer.json file or directory "
        "containing one, nor the name of a Hugging Face hub model"
    )


def _is_hub_name(spec: str) -> bool:
    """Whether ``spec`` can be a hub model id (``name`` or ``org/name``). A URL, or a name
    ending in ``.json`` (a tokenizer file that is not there), is not one."""
    if "://" in spec or spec.endswith(".json"):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def _hub_snapshot(name: str) -> str:
    """The directory of the Hugging Face cache holding the tokenizer files of hub model
    ``name`` at its main revision: downloaded when the hub is reachable (and
    ``HF_HUB_OFFLINE`` is not set), else the copy already in the cache."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return snapshot_download(name, allow_patterns=list(HUB_TOKENIZER_FILES))
    except LocalEntryNotFoundError as e:  # offline, or the hub unreachable, and nothing cached
        why = (
            "HF_HUB_OFFLINE is set"
            if constants.is_offline_mode()
            else f"the hub could not be reached ({type(e.__cause__ or e).__name__})"
        )
        raise DataError(
            f"data.tokenizer: {name!r} is not a local path, and the tokenizer of the Hugging Face hub model "
            f"{name!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and cannot be downloaded: "
            f"{why}. Fetch it on a machine with network access, into a Hugging Face cache that this one "
            f"reads (HF_HUB_CACHE): `hf download {name} {' '.join(HUB_TOKENIZER_FILES[:2])}` (for a "
            f"{CTC_TOKENIZER_CLASS}, which has no tokenizer.json: `hf download {name} "
            "vocab.json tokenizer_config.json special_tokens_map.json`); or set data.tokenizer to a local "
            "directory holding tokenizer.json and tokenizer_config.json"
        ) from None
    except RepositoryNotFoundError:  # also a gated or private model without access
        raise DataError(
            f"data.tokenizer: {name!r} is not a local path, and the Hugging Face hub has no model {name!r} "
            "that you can read (a private or gated model needs `hf auth login` and, for a gated one, its "
            "terms accepted on the hub)"
        ) from None
    except Exception as e:  # the hub's other HTTP errors, a proxy refusing...
        raise DataError(
            f"data.tokenizer: the tokenizer of the Hugging Face hub model {name!r} could not be fetched: {e}"
        ) from None


def _tokenizer_config(fs, directory: str) -> dict:
    """The ``tokenizer_config.json`` beside a tokenizer; {} if there is none. A file that
    is there but unreadable is an error: silently losing its chat template would change
    what is trained on."""
    return _read_json_object(fs, posixpath.join(directory, "tokenizer_config.json"), missing_ok=True)


def _token_text(token) -> str | None:
    # Special tokens are written as text, or as an AddedToken object with a "content".
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(fs, directory: str, config: dict) -> str | None:
    """The ``chat_template`` of the config (a string, or a list of named templates of which
    ``default`` is used), else the ``chat_template.jinja`` file, else None."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_path = posixpath.join(directory, "chat_template.jinja")
    if fs.isfile(jinja_path):
        with fs.open(jinja_path, "r", encoding="utf-8") as f:
            return f.read()
    return None


# -- Wav2Vec2 CTC tokenizers -----------------------------------------------------------------
#
# transformers' Wav2Vec2CTCTokenizer is "slow" only: a vocab.json of characters and a few
# special tokens. It encodes a text one character per token, after upper-casing the text when
# do_lower_case is set (the flag means "accept lowercase input"), with each space written as
# the word delimiter token; a character not in the vocabulary is the unknown token; the tokens
# of the vocabulary longer than one character (the special ones) are matched in the text first,
# swallowing the whitespace around them; and it adds nothing around a text. The same, as a
# `tokenizers` pipeline: added tokens, an upper-casing and space-replacing normalizer, a split
# into characters and a word-level model.


def _is_ctc_tokenizer(fs, directory: str) -> bool:
    """Whether ``directory`` holds a Wav2Vec2 CTC tokenizer: a ``vocab.json`` and a
    ``tokenizer_config.json`` naming its class."""
    return (
        fs.isfile(posixpath.join(directory, "vocab.json"))
        and _tokenizer_config(fs, directory).get("tokenizer_class") == CTC_TOKENIZER_CLASS
    )


# Wav2Vec2CTCTokenizer's defaults, in the order in which transformers adds those missing from
# the vocabulary (so that they get the same ids).
_CTC_SPECIAL_DEFAULTS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def _load_ctc_tokenizer(spec: str, fs, directory: str) -> HfTokenizer:
    config = _tokenizer_config(fs, directory)
    vocab = _ctc_vocab(fs, posixpath.join(directory, "vocab.json"), config.get("target_lang"))
    # As transformers reads them: special_tokens_map.json over tokenizer_config.json, unless
    # the latter lists its added tokens itself; then the class's defaults.
    specials = dict(config)
    if "added_tokens_decoder" not in config:
        specials |= _read_json_object(fs, posixpath.join(directory, "special_tokens_map.json"), missing_ok=True)
    token = {key: _token_text(specials.get(key, default)) for key, default in _CTC_SPECIAL_DEFAULTS.items()}
    if token["unk_token"] not in vocab:
        raise DataError(
            f"{posixpath.join(directory, 'vocab.json')}: has no entry for the unknown token "
            f"{token['unk_token']!r} (unk_token of tokenizer_config.json), which characters outside the "
            "vocabulary encode as"
        )
    tokenizer_json = _ctc_tokenizer_json(
        vocab,
        special_tokens=[t for t in token.values() if t],
        unk_token=token["unk_token"],
        word_delimiter_token=_token_text(config.get("word_delimiter_token")) or "|",
        do_lower_case=bool(config.get("do_lower_case", False)),
        replace_word_delimiter_char=config.get("replace_word_delimiter_char", " "),
    )
    return HfTokenizer(
        spec,
        tokenizer_json,
        token["eos_token"],
        bos_token=token["bos_token"],
        chat_template=_chat_template(fs, directory, config),
    )


def _ctc_tokenizer_json(
    vocab: dict[str, int],
    *,
    special_tokens: list[str],
    unk_token: str = "<unk>",
    word_delimiter_token: str = "|",
    do_lower_case: bool = False,
    replace_word_delimiter_char: str = " ",
) -> str:
    """A ``tokenizer.json`` that encodes as ``transformers``' ``Wav2Vec2CTCTokenizer`` with
    this vocabulary and these settings (``do_lower_case`` upper-cases the text first). It
    decodes ids as text, the word delimiter written as ``replace_word_delimiter_char`` and
    repeated tokens kept (collapsing the repeats of a CTC output is the model's business)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    tok = RustTokenizer(models.WordLevel(vocab, unk_token=unk_token))
    replacements = []
    if do_lower_case:
        # Only the characters whose ids upper-casing changes: a-z, and the few (ß, ﬁ...) that
        # become several characters.
        replacements = [
            normalizers.Replace(c, upper)
            for c, upper in _uppercased_characters().items()
            if [vocab.get(u) for u in upper] != [vocab.get(c)]
        ]
    tok.normalizer = normalizers.Sequence([*replacements, normalizers.Replace(" ", word_delimiter_token)])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token a character
    tok.decoder = decoders.Sequence(
        [decoders.Replace(word_delimiter_token, replace_word_delimiter_char), decoders.Fuse()]
    )

    # Matched in the raw text, before upper-casing. Those of the vocabulary longer than one
    # character take the whitespace around them along; special tokens missing from it (which
    # get the next ids, in the order given) do not.
    def added(content: str, special: bool) -> AddedToken:
        strip = len(content) > 1 and content in vocab
        return AddedToken(content, lstrip=strip, rstrip=strip, normalized=False, special=special)

    tok.add_special_tokens([added(t, True) for t in dict.fromkeys(special_tokens)])
    tok.add_tokens([added(t, False) for t in vocab if len(t) > 1 and t not in special_tokens])
    return tok.to_str()


@functools.cache
def _uppercased_characters() -> dict[str, str]:
    """Every character that ``str.upper`` changes, and what it becomes (some 1,500)."""
    return {c: upper for c in map(chr, range(sys.maxunicode + 1)) if (upper := c.upper()) != c}


def _ctc_vocab(fs, path: str, target_lang: str | None) -> dict[str, int]:
    """The token -> id object of a ``vocab.json``; a multilingual one (an object per language)
    gives the vocabulary of ``target_lang``."""
    vocab = _read_json_object(fs, path)
    languages = sorted(lang for lang, v in vocab.items() if isinstance(v, dict))
    if target_lang is not None or (languages and len(languages) == len(vocab)):
        if target_lang not in languages:
            raise DataError(
                f"{path}: target_lang of tokenizer_config.json is {target_lang!r}, and the file's vocabularies "
                f"per language are: {', '.join(languages[:20]) or 'none (it is a single vocabulary)'}; set "
                "target_lang to one of them"
            )
        vocab = vocab[target_lang]
    bad = [(t, i) for t, i in vocab.items() if not isinstance(i, int) or isinstance(i, bool) or i < 0]
    if bad:
        raise DataError(f"{path}: expected token -> id (a non-negative integer); found {bad[0][0]!r}: {bad[0][1]!r}")
    return vocab


def _read_json_object(fs, path: str, missing_ok: bool = False) -> dict:
    """The JSON object in file ``path``; {} if there is no such file and ``missing_ok``. A
    file that is not a JSON object is an error naming the file (and the line)."""
    if missing_ok and not fs.isfile(path):
        return {}
    with fs.open(path, "r", encoding="utf-8") as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value
