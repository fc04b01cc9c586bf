"""Wav2Vec2 CTC tokenizers (speech models such as ``facebook/wav2vec2-base-960h``), which come
without a ``tokenizer.json``: recognized by their ``tokenizer_config.json``, and their
``vocab.json`` rebuilt as a ``tokenizer.json`` that encodes as ``transformers`` does."""

from __future__ import annotations

import functools
import posixpath
import sys

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from levanter_core.data.tokenizer.base import HfTokenizer
from levanter_core.data.tokenizer.files import _chat_template, _read_json_object, _token_text, _tokenizer_config
from levanter_core.errors import DataError

CTC_TOKENIZER_CLASS = "Wav2Vec2CTCTokenizer"
"""The ``tokenizer_class`` of a ``tokenizer_config.json`` whose ``vocab.json`` we rebuild as a
``tokenizer.json`` (the one slow-only tokenizer we read)."""


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
