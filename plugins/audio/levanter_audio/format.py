"""``format: {type: audio}``: speech with its transcript, one utterance per record.

Each record (a line of a JSON-lines manifest, a row of a Parquet file or of a Hugging Face
dataset) holds the audio under ``audio_key`` and the words spoken under ``text_key``, in the
forms :mod:`levanter_audio.manifest` reads (a path relative to the file the record is in, a
URL, or a Hugging Face ``Audio`` object). The cache keeps, for each utterance:

* its transcript's token ids: the tokenizer's encoding of the text (with the special tokens the
  tokenizer adds on its own), after a start token when ``enforce_bos`` (the tokenizer's BOS;
  for a tokenizer without one, its end-of-text token, as GPT-2 starts texts), and ending with
  the end-of-text token (``data.enforce_eos``);
* its samples (``audio``, float32), mono at 16 kHz.

Each utterance is one batch row (the ``document`` layout): its samples padded with silence
or cut to the window the model hears (Whisper: 30 s), its transcript padded or cut to
``seq_len``. The training objective computes the features from the samples (``asr``: on
the device, inside the step).

A bad record (unreadable, truncated or empty audio, a missing or empty transcript) is an
error naming the file and line, or is skipped and counted with ``data.skip_bad_data``.
"""

from __future__ import annotations

import os
import posixpath
from typing import Literal

import numpy as np
from pydantic import Field

from levanter_audio.manifest import parse_record
from levanter_core.data.formats import Encoded, FormatConfig, append_eos
from levanter_core.data.tokenizer import Tokenizer
from levanter_core.errors import DataError

AUDIO_FIELD = "audio"
"""The name of the samples among each document's fields (and of the batch's array)."""


class AudioFormat(FormatConfig):
    """Audio with its transcript: each record one utterance, one batch row, trained on the
    transcript given the audio."""

    type: Literal["audio"] = "audio"
    """``audio``: an utterance per record (speech recognition)."""

    audio_key: str = Field("audio", min_length=1)
    """The field of a record that holds the audio: a path (relative to the file the record is
    in) or URL of an audio file (WAV, FLAC, MP3, OGG...), or a Hugging Face ``Audio`` object
    (``{"path"}``, ``{"bytes"}``, or ``{"array", "sampling_rate"}``)."""

    text_key: str = Field("text", min_length=1)
    """The field of a record that holds the transcript (Levanter's default, ``text``)."""

    enforce_bos: bool = True
    """Start every transcript with a start token when the tokenizer adds none itself: its BOS
    token, or its end-of-text token if it has no BOS (the decoder needs a token to predict the
    first word from)."""

    @property
    def layout(self) -> str:
        return "document"

    def document_fields(self) -> dict[str, str]:
        return {AUDIO_FIELD: "float32"}

    def encode_batch(self, values, wheres, tokenizer: Tokenizer, eos_id: int | None):
        utterances: list = []
        for value, where in zip(values, wheres):
            try:
                utterances.append(
                    parse_record(
                        value, where, base=_directory_of(where), text_key=self.text_key, audio_key=self.audio_key
                    )
                )
            except DataError as e:
                utterances.append(e)
        texts = [u.text for u in utterances if not isinstance(u, DataError)]
        ids = iter(transcript_ids(tokenizer, texts, enforce_bos=self.enforce_bos))
        out: list[Encoded | DataError] = []
        for utterance in utterances:
            if isinstance(utterance, DataError):
                out.append(utterance)
                continue
            tokens = append_eos(next(ids), eos_id)
            out.append(Encoded(tokens, fields={AUDIO_FIELD: np.ascontiguousarray(utterance.audio, np.float32)}))
        return out


def transcript_ids(tokenizer: Tokenizer, texts: list[str], *, enforce_bos: bool = True) -> list[np.ndarray]:
    """Each text's ids as :class:`AudioFormat` stores them, without the end-of-text token that
    ends a stored transcript (unless the tokenizer's own encoding ends with it)."""
    encoded = [ids for ids, _ in tokenizer.encode_with_offsets(texts, add_special_tokens=True)]
    start = _added_start(tokenizer, enforce_bos)
    if start is None:
        return encoded
    return [np.concatenate([np.array([start], np.int32), ids]) for ids in encoded]


def transcript_prompt(tokenizer: Tokenizer, enforce_bos: bool = True) -> list[int]:
    """The ids a stored transcript starts with before its first word: what the tokenizer puts
    before any text (Whisper's ``<|startoftranscript|>`` and the like), or else the start token
    of ``enforce_bos``. A model trained on :class:`AudioFormat` data is prompted with them."""
    start = _added_start(tokenizer, enforce_bos)
    return [start] if start is not None else _leading(tokenizer)


def _leading(tokenizer: Tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text of its own accord (its encoding of an empty
    text, less an end-of-text token it appends)."""
    ((ids, _),) = tokenizer.encode_with_offsets([""], add_special_tokens=True)
    ids = ids.tolist()
    if ids and ids[-1] == tokenizer.eos_id:
        ids.pop()
    return ids


def _added_start(tokenizer: Tokenizer, enforce_bos: bool) -> int | None:
    """The start token :class:`AudioFormat` puts before each transcript: with ``enforce_bos``,
    when the tokenizer puts nothing before a text itself, its BOS token, else its end-of-text
    token (as GPT-2 starts texts); None when nothing is added."""
    if not enforce_bos or _leading(tokenizer):
        return None
    return tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id


def _directory_of(where: str) -> str:
    """The directory of the file a record came from (``path:line``, ``path:row N``): relative
    audio paths start there."""
    path = where.rsplit(":", 1)[0] if ":" in where.split("://")[-1] else where
    return posixpath.dirname(path) if "://" in path else os.path.dirname(os.path.abspath(path))
