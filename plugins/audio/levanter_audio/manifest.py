"""Manifests: files that pair audio with its transcript, one utterance per record.

The usual manifest is JSON lines::

    {"audio": "clips/0001.flac", "text": "the cat sat on the mat"}
    {"audio": "s3://bucket/clips/0002.wav", "text": "and did not move"}

Any file kind that levanter-core's ``type: url`` source reads works the same way
(``.jsonl``, ``.json``, ``.parquet``, compressed or not, local or on an object store).
The audio field (``audio_key``, ``"audio"`` by default, as in Levanter's
``AudioDatasetSourceConfig``) holds, as in Levanter:

* a path or URL, relative paths being relative to the manifest's directory;
* or an object in the shape of Hugging Face ``datasets``' ``Audio`` feature:
  ``{"path": ...}``, ``{"bytes": ...}`` (base64 text in JSON), or
  ``{"array": [...], "sampling_rate": N}``.

The transcript field is ``text_key`` (``"text"``; Levanter's URL reader used
``"sentence"``, Common Voice's column name). Each utterance's audio comes back mono,
float32, at 16 kHz."""

from __future__ import annotations

import base64
import binascii
import os
import posixpath
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from levanter_audio.io import SAMPLE_RATE, load_audio, resample
from levanter_core.data.source import read_records
from levanter_core.errors import DataError


class Utterance(NamedTuple):
    """One record of a manifest."""

    audio: np.ndarray
    """Mono float32 samples in [-1, 1] at the requested rate (16 kHz by default)."""
    text: str
    """The transcript."""
    where: str
    """``manifest:line`` (``manifest:item N`` in a ``.json`` file), for messages."""


def read_manifest(
    path: str | os.PathLike,
    *,
    text_key: str = "text",
    audio_key: str = "audio",
    sampling_rate: int = SAMPLE_RATE,
    start: int = 0,
) -> Iterator[Utterance]:
    """The utterances of a manifest, in order, from the ``start``-th record on.

    Raises :class:`DataError` naming the manifest and line for a line that is not a JSON
    object, a record without ``audio_key`` or ``text_key``, an empty or non-string
    transcript, or audio that cannot be read (see :func:`levanter_audio.io.load_audio`);
    and naming the manifest for one that does not exist."""
    url = os.fspath(path)
    base = _directory(url)
    for record in read_records(url, start):
        if isinstance(record.value, DataError):
            raise record.value
        yield parse_record(
            record.value, record.where, base=base, text_key=text_key, audio_key=audio_key, sampling_rate=sampling_rate
        )


def parse_record(
    record: dict | str,
    where: str,
    *,
    base: str,
    text_key: str = "text",
    audio_key: str = "audio",
    sampling_rate: int = SAMPLE_RATE,
) -> Utterance:
    """One manifest record as an :class:`Utterance`; ``base`` is the directory that
    relative audio paths start from (the manifest's). For a data source that reads the
    records itself (with ``levanter_core.data.source.read_records``, say)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with {audio_key!r} and {text_key!r}, found text")
    keys = ", ".join(map(repr, record)) or "none"
    if audio_key not in record:
        raise DataError(f"{where}: no {audio_key!r} field (the audio); the record has {keys}")
    if text_key not in record:
        raise DataError(f"{where}: no {text_key!r} field (the transcript); the record has {keys}")
    text = record[text_key]
    if not isinstance(text, str):
        raise DataError(f"{where}: the transcript {text_key!r} should be a string, found {type(text).__name__}")
    if not text.strip():
        raise DataError(f"{where}: empty transcript in {text_key!r}")
    audio = resolve_audio(record[audio_key], base=base, where=where, sampling_rate=sampling_rate)
    return Utterance(audio, text, where)


def resolve_audio(pointer, *, base: str, where: str, sampling_rate: int = SAMPLE_RATE) -> np.ndarray:
    """The samples a manifest's audio field points to (a path, or a Hugging Face ``Audio``
    object: see the module's description), mono float32 at ``sampling_rate``."""
    if isinstance(pointer, str):
        if not pointer.strip():
            raise DataError(f"{where}: empty audio path")
        return load_audio(_join(base, pointer), sampling_rate=sampling_rate, where=where)
    if isinstance(pointer, dict):
        if "array" in pointer and "sampling_rate" in pointer:
            return _from_array(pointer["array"], pointer["sampling_rate"], where, sampling_rate)
        if pointer.get("bytes") is not None:
            data = pointer["bytes"]
            if isinstance(data, str):
                try:
                    data = base64.b64decode(data, validate=True)
                except (binascii.Error, ValueError):
                    raise DataError(f"{where}: the audio's 'bytes' is text but not base64") from None
            return load_audio(bytes(data), sampling_rate=sampling_rate, where=where)
        if isinstance(pointer.get("path"), str):
            return resolve_audio(pointer["path"], base=base, where=where, sampling_rate=sampling_rate)
        found = ", ".join(map(repr, pointer)) or "no keys"
        raise DataError(
            f"{where}: the audio object has {found}; expected 'path', 'bytes', or 'array' with 'sampling_rate'"
        )
    raise DataError(f"{where}: the audio should be a path or an object, found {type(pointer).__name__}")


def _from_array(array, rate, where: str, sampling_rate: int) -> np.ndarray:
    try:
        samples = np.asarray(array, dtype=np.float32)
        rate = int(rate)
    except (TypeError, ValueError):
        raise DataError(f"{where}: the audio 'array' should be numbers and 'sampling_rate' an integer") from None
    if samples.ndim == 2:  # channels last, as soundfile gives them
        samples = samples.mean(axis=1, dtype=np.float32)
    if samples.ndim != 1 or samples.size == 0:
        raise DataError(f"{where}: the audio 'array' holds no samples (shape {samples.shape})")
    if rate <= 0:
        raise DataError(f"{where}: the audio 'sampling_rate' should be positive, found {rate}")
    if not np.isfinite(samples).all():
        raise DataError(f"{where}: the audio 'array' holds NaN or infinite samples")
    audio = resample(samples, rate, sampling_rate)
    if audio.size == 0:
        raise DataError(f"{where}: the audio 'array' is too short to have a sample at {sampling_rate} Hz")
    return audio


def _directory(url: str) -> str:
    return posixpath.dirname(url) if "://" in url else os.path.dirname(os.path.abspath(url))


def _join(base: str, path: str) -> str:
    if "://" in path or os.path.isabs(path):
        return path
    return posixpath.join(base, path) if "://" in base else os.path.join(base, path)
