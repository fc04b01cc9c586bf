"""Whisper's input features: the log-mel spectrogram of 30 s of 16 kHz audio.

The recipe is OpenAI Whisper's, as Hugging Face's ``WhisperFeatureExtractor`` computes
it, and the numbers agree with it to within 1e-4:

* the audio is cut to, or padded with zeros to, 30 s (480,000 samples);
* a short-time Fourier transform with a 400-point periodic Hann window every 160 samples
  (25 ms windows, 10 ms apart), the signal reflected by 200 samples at each end so that
  frame ``t`` is centred on sample ``160 t``; the last of the 3,001 frames is dropped,
  leaving 3,000;
* the power spectrum through a bank of ``n_mels`` triangular filters, 0 to 8 kHz, evenly
  spaced on the Slaney mel scale and area-normalised (80 filters for Whisper up to
  large-v2, 128 for large-v3);
* ``log10``, with powers below 1e-10 raised to it; everything more than 8 (decades) below
  the clip's maximum raised to that floor; then ``(x + 4) / 4``.

:func:`log_mel_spectrogram` computes it with numpy (float64 inside) for one clip, and also
returns how many of the 3,000 frames hold audio rather than padding;
:func:`log_mel_spectrogram_jax` computes it with ``jax.numpy`` for a batch of clips already
padded by :func:`pad_or_trim`, so it can run inside a jitted step, on a device."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SAMPLE_RATE = 16_000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480,000
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3,000
LOG_FLOOR = 1e-10
DYNAMIC_RANGE = 8.0  # decades kept below the maximum


class LogMel(NamedTuple):
    """One clip's features."""

    features: np.ndarray
    """float32, shape ``(n_mels, 3000)``: the log-mel spectrogram of the padded clip."""
    num_frames: int
    """How many leading frames hold audio: ``ceil(len(audio) / 160)``, at most 3,000. The
    rest is padding (the frame that straddles the end of the audio counts as audio, as in
    ``WhisperFeatureExtractor``'s attention mask)."""


def hann_window(length: int = N_FFT) -> np.ndarray:
    """The periodic Hann window (``torch.hann_window``'s default): one period of
    ``sin^2`` sampled at ``length`` points, the last point left out so that windows 50%
    apart would add up to a constant."""
    k = np.arange(length, dtype=np.float64)
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * k / length)


# The Slaney mel scale (Auditory Toolbox; librosa's default, htk=False): linear, 200/3 Hz
# per mel, up to 1 kHz (mel 15), logarithmic above, 27 mels per factor of 6.4.
_LINEAR_HZ_PER_MEL = 200.0 / 3.0
_BREAK_HZ = 1000.0
_BREAK_MEL = _BREAK_HZ / _LINEAR_HZ_PER_MEL
_LOG_STEP = math.log(6.4) / 27.0


def hz_to_mel(hz) -> np.ndarray:
    """Frequencies in Hz on the Slaney mel scale."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / _LINEAR_HZ_PER_MEL
    logarithmic = _BREAK_MEL + np.log(np.maximum(hz, _BREAK_HZ) / _BREAK_HZ) / _LOG_STEP
    return np.where(hz < _BREAK_HZ, linear, logarithmic)


def mel_to_hz(mel) -> np.ndarray:
    """The inverse of :func:`hz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    linear = mel * _LINEAR_HZ_PER_MEL
    logarithmic = _BREAK_HZ * np.exp(_LOG_STEP * (np.maximum(mel, _BREAK_MEL) - _BREAK_MEL))
    return np.where(mel < _BREAK_MEL, linear, logarithmic)


def mel_filter_bank(
    n_mels: int = 80,
    *,
    n_fft: int = N_FFT,
    sampling_rate: int = SAMPLE_RATE,
    f_min: float = 0.0,
    f_max: float = 8000.0,
) -> np.ndarray:
    """Triangular filters, shape ``(n_fft // 2 + 1, n_mels)`` (float64): filter ``m``
    rises from edge ``m`` to edge ``m + 1`` and falls to edge ``m + 2``, where the
    ``n_mels + 2`` edges are evenly spaced in mel between ``f_min`` and ``f_max``. Each
    filter is scaled by ``2 / (its width in Hz)`` so that all have the same area (Slaney's
    normalisation), as Whisper's filters are."""
    bins = np.linspace(0.0, sampling_rate // 2, n_fft // 2 + 1)[:, None]
    edges = mel_to_hz(np.linspace(hz_to_mel(f_min), hz_to_mel(f_max), n_mels + 2))
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]
    rising = (bins - lower) / (centre - lower)
    falling = (upper - bins) / (upper - centre)
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    return triangles * (2.0 / (upper - lower))


@lru_cache(maxsize=8)
def _filters(n_mels: int) -> np.ndarray:
    bank = mel_filter_bank(n_mels)
    bank.flags.writeable = False
    return bank


def num_valid_frames(num_samples: int) -> int:
    """How many of the 3,000 frames of a clip of ``num_samples`` samples hold audio."""
    return min(N_FRAMES, -(-int(num_samples) // HOP_LENGTH))


def pad_or_trim(audio: np.ndarray, num_samples: int = N_SAMPLES) -> np.ndarray:
    """``audio`` (1-d) cut to, or padded with zeros to, ``num_samples`` (30 s), float32."""
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"expected mono audio (one dimension), got shape {audio.shape}")
    out = np.zeros(num_samples, dtype=np.float32)
    kept = min(num_samples, audio.shape[0])
    out[:kept] = audio[:kept]
    return out


def log_mel_spectrogram(audio: np.ndarray, *, n_mels: int = 80) -> LogMel:
    """Whisper's features of one clip of 16 kHz mono audio (see the module's description):
    float32 of shape ``(n_mels, 3000)``, and the number of frames that hold audio. Audio
    longer than 30 s is cut to its first 30 s."""
    audio = np.asarray(audio)
    padded = pad_or_trim(audio).astype(np.float64)
    signal = np.pad(padded, N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(signal, N_FFT)[::HOP_LENGTH][:N_FRAMES]
    spectrum = np.fft.rfft(frames * hann_window(), axis=-1)
    power = spectrum.real**2 + spectrum.imag**2
    log_mel = np.log10(np.maximum(power @ _filters(n_mels), LOG_FLOOR))
    log_mel = np.maximum(log_mel, log_mel.max() - DYNAMIC_RANGE)
    features = ((log_mel + 4.0) / 4.0).T.astype(np.float32)
    return LogMel(np.ascontiguousarray(features), num_valid_frames(audio.shape[0]))


def log_mel_spectrogram_jax(audio, *, n_mels: int = 80):
    """:func:`log_mel_spectrogram` in ``jax.numpy``, for clips already padded with zeros (or
    cut) to one length, a multiple of 160 samples: :func:`pad_or_trim` makes them 480,000
    samples (30 s), and ``audio`` of shape ``(..., 480000)`` gives ``(..., n_mels, 3000)``
    float32, each clip floored against its own maximum. A shorter window (a small model's,
    ``2 * max_source_positions`` frames) gives that many frames, equal to the first frames of the
    30-second features of the same clip when the clip fits in the window. Traceable
    (``jax.jit``); computed in float32, it agrees with the numpy version to about 1e-5."""
    audio = jnp.asarray(audio, dtype=jnp.float32)
    if audio.shape[-1] % HOP_LENGTH or audio.shape[-1] <= N_FFT // 2:
        raise ValueError(
            f"expected clips of a multiple of {HOP_LENGTH} samples, more than {N_FFT // 2} (use pad_or_trim), "
            f"got shape {audio.shape}"
        )
    pad = [(0, 0)] * (audio.ndim - 1) + [(N_FFT // 2, N_FFT // 2)]
    signal = jnp.pad(audio, pad, mode="reflect")
    starts = np.arange(audio.shape[-1] // HOP_LENGTH) * HOP_LENGTH
    frames = signal[..., starts[:, None] + np.arange(N_FFT)[None, :]]
    spectrum = jnp.fft.rfft(frames * hann_window().astype(np.float32), axis=-1)
    power = jnp.real(spectrum) ** 2 + jnp.imag(spectrum) ** 2
    # Full float32 products: accelerators otherwise multiply float32 matrices in lower
    # precision (TF32, bfloat16 passes), several times the 1e-4 this must stay within.
    mel = jnp.matmul(power, _filters(n_mels).astype(np.float32), precision=jax.lax.Precision.HIGHEST)
    log_mel = jnp.log10(jnp.maximum(mel, LOG_FLOOR))
    peak = jnp.max(log_mel, axis=(-2, -1), keepdims=True)
    log_mel = jnp.maximum(log_mel, peak - DYNAMIC_RANGE)
    return jnp.swapaxes((log_mel + 4.0) / 4.0, -1, -2)
