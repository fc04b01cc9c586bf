"""Reading audio: any file libsndfile decodes (WAV, FLAC, MP3, OGG/Vorbis, ...), as mono
float32 in [-1, 1] at 16 kHz, Whisper's rate.

Resampling uses `soxr <https://pypi.org/project/soxr/>`_ (the SoX resampler: a
band-limited polyphase filter, fast, deterministic, no other dependency than numpy) at its
high-quality setting.

Every problem with an input is a :class:`~levanter_core.errors.DataError` whose message
starts with where it came from (``manifest.jsonl:12: audio clips/a.wav: ...``, or the
file alone) and says what is wrong, so the CLI prints it without a traceback."""

from __future__ import annotations

import io
import os
import re
from typing import BinaryIO

import fsspec
import numpy as np
import soundfile
import soxr

from levanter_core.errors import DataError

SAMPLE_RATE = 16_000
"""Hz: the rate Whisper's features are computed at, and the default of every reader here."""

# libsndfile reports a RIFF/W64 data chunk that is longer than the file as
# "data : 64000 (should be 31978)" in its log.
_SHORT_DATA_CHUNK = re.compile(r"^data\s*:\s*(\d+)\s*\(should be (\d+)\)", re.MULTILINE)
# Streaming writers (ffmpeg to a pipe, for example) leave the data size unknown: 0 or all ones.
_UNKNOWN_SIZES = {0, 0xFFFFFFFF, 0x7FFFFFFF, 0xFFFFFFFFFFFFFFFF}
# An MP3's length comes from its Xing/Info header, and the decoder's priming and padding can
# make the decoded count differ by a frame or so: only a larger shortfall means truncation.
_MP3_SLACK = 2 * 1152


def load_audio(
    source: str | os.PathLike | bytes | BinaryIO,
    *,
    sampling_rate: int = SAMPLE_RATE,
    where: str | None = None,
) -> np.ndarray:
    """The samples of one audio file: mono (channels averaged), resampled to
    ``sampling_rate``, float32 in [-1, 1].

    ``source`` is a local path, an fsspec URL (``s3://``, ``gs://``, ``memory://``...), the
    file's bytes, or an open binary file. ``where`` (``"manifest.jsonl:12"``) starts every
    error message; the file's name follows it.

    Raises :class:`DataError` for a file that does not exist or cannot be read, is empty,
    is not audio, is truncated (fewer samples than its header announces), holds no
    samples, or holds NaN or infinite samples."""
    label = _label(source, where)
    with _open(source, label) as f:
        samples, rate = _decode(f, label)
    if samples.shape[0] == 0:
        raise DataError(f"{label}: holds no audio samples (0 frames)")
    if not np.isfinite(samples).all():
        raise DataError(f"{label}: holds NaN or infinite samples")
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    audio = resample(mono, rate, sampling_rate)
    if audio.shape[0] == 0:
        raise DataError(f"{label}: too short: {samples.shape[0]} samples at {rate} Hz are none at {sampling_rate} Hz")
    return audio


def resample(audio: np.ndarray, orig_rate: int, new_rate: int = SAMPLE_RATE) -> np.ndarray:
    """``audio`` (1-d) from ``orig_rate`` to ``new_rate`` Hz, float32 clipped to [-1, 1].
    The length becomes ``round(len(audio) * new_rate / orig_rate)``."""
    if orig_rate <= 0 or new_rate <= 0:
        raise ValueError(f"sampling rates must be positive, got {orig_rate} and {new_rate}")
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"expected mono audio (one dimension), got shape {audio.shape}")
    if orig_rate != new_rate:
        audio = soxr.resample(audio, orig_rate, new_rate, quality="HQ")
    # Band-limiting a full-scale signal rings slightly past full scale.
    return np.clip(audio, -1.0, 1.0).astype(np.float32, copy=False)


def _label(source, where: str | None) -> str:
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        name = "bytes"
    else:
        name = str(getattr(source, "name", None) or "stream")
    if where:
        return f"{where}: audio {name}"
    return name if isinstance(source, (str, os.PathLike)) else f"audio {name}"


class _open:
    """A seekable binary file for ``source``, with the errors of opening it as DataErrors."""

    def __init__(self, source, label: str):
        self.source, self.label, self._close = source, label, None

    def __enter__(self) -> BinaryIO:
        source = self.source
        if isinstance(source, (bytes, bytearray, memoryview)):
            f = io.BytesIO(source)
        elif isinstance(source, (str, os.PathLike)):
            f = self._open_path(os.fspath(source))
            self._close = f
        else:
            f = source
        return f

    def __exit__(self, *exc):
        if self._close is not None:
            self._close.close()

    def _open_path(self, path: str) -> BinaryIO:
        if "://" in path:
            opener = fsspec.open(path, "rb")
            try:
                return opener.open()
            except FileNotFoundError:
                raise DataError(f"{self.label}: no such file") from None
            except OSError as e:
                raise DataError(f"{self.label}: cannot read the file ({type(e).__name__}: {e})") from None
        if os.path.isdir(path):
            raise DataError(f"{self.label}: is a directory, not an audio file")
        try:
            return open(path, "rb")
        except FileNotFoundError:
            raise DataError(f"{self.label}: no such file") from None
        except OSError as e:
            raise DataError(f"{self.label}: cannot read the file ({e.strerror or e})") from None


def _decode(f: BinaryIO, label: str) -> tuple[np.ndarray, int]:
    """(frames x channels float32 samples, rate) of an open file."""
    start = f.tell()
    if not f.read(1):
        raise DataError(f"{label}: empty file (0 bytes)")
    f.seek(start)
    try:
        snd = soundfile.SoundFile(f)
    except (soundfile.LibsndfileError, RuntimeError) as e:
        raise DataError(
            f"{label}: not an audio file that can be decoded ({_reason(e)}); expected WAV, FLAC, MP3 or OGG audio"
        ) from None
    with snd:
        announced = snd.frames
        try:
            samples = snd.read(dtype="float32", always_2d=True)
        except (soundfile.LibsndfileError, RuntimeError) as e:
            raise DataError(f"{label}: truncated or corrupt audio data ({_reason(e)})") from None
        shortfall = _truncation(snd, announced, samples.shape[0])
        if shortfall:
            raise DataError(f"{label}: truncated: {shortfall}; the file was cut short (copy or download it again)")
        return samples, snd.samplerate


def _truncation(snd: soundfile.SoundFile, announced: int, decoded: int) -> str | None:
    """What says the file is shorter than its header announces, or None."""
    match = _SHORT_DATA_CHUNK.search(snd.extra_info or "")
    if match:
        declared, present = int(match.group(1)), int(match.group(2))
        if declared not in _UNKNOWN_SIZES and declared > present:
            return f"its header announces {declared} bytes of audio data, only {present} are present"
    slack = _MP3_SLACK if snd.format == "MP3" else 0
    if 0 < announced < 2**62 and decoded + slack < announced:
        return f"its header announces {announced} samples, only {decoded} could be decoded"
    return None


def _reason(e: Exception) -> str:
    # soundfile's messages start with "Error opening <object at 0x...>: ", which says nothing.
    text = str(e)
    if text.startswith("Error opening") and ": " in text:
        text = text.split(": ", 1)[1]
    return f"libsndfile: {text.strip()}"
