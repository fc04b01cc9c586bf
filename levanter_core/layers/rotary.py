"""Rotary position embeddings (RoPE) and the scalings that stretch them to longer contexts.

The ``rope:`` field of a model config picks one by ``type``::

    rope: {type: default, theta: 10000}
    rope: {type: linear, theta: 10000, factor: 8}
    rope: {type: llama3, theta: 500000, factor: 8, low_freq_factor: 1, high_freq_factor: 4,
           original_max_position_embeddings: 8192}
    rope: {type: yarn, theta: 10000, factor: 4, original_max_position_embeddings: 4096}

Each computes the inverse frequencies of the ``head_size / 2`` rotation planes and a
factor applied to the cosines and sines, with the same arithmetic (in float32) as
Hugging Face's ``modeling_rope_utils``, so imported models give the same logits.
The rotation pairs dimension ``i`` with ``i + head_size / 2`` ("rotate half"), the
layout of Hugging Face checkpoints, so no weights need permuting on import.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Union

import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray
from pydantic import Field, PositiveFloat, PositiveInt

from levanter_core.config.base import ConfigModel


class _RotaryBase(ConfigModel):
    theta: PositiveFloat = 10000.0
    """Base wavelength of the rotations (Hugging Face's ``rope_theta``)."""

    def inverse_frequencies(self, head_size: int) -> np.ndarray:
        """The ``head_size / 2`` angular frequencies, float32."""
        return (1.0 / (self.theta ** (np.arange(0, head_size, 2, dtype=np.int64).astype(np.float32) / head_size))).astype(
            np.float32
        )

    def table_scale(self) -> float:
        """Multiplies the cosines and sines (YaRN's attention temperature); 1 for the others."""
        return 1.0

    def to_hf(self) -> dict:
        """The Hugging Face ``rope_parameters`` dictionary of this scaling."""
        return {"rope_type": self.type, "rope_theta": self.theta}


class DefaultRotaryConfig(_RotaryBase):
    """Plain RoPE (Su et al., 2021)."""

    type: Literal["default"] = "default"
    """``default``: no scaling."""


class LinearRotaryConfig(_RotaryBase):
    """Position interpolation: every frequency divided by ``factor``."""

    type: Literal["linear"] = "linear"
    """``linear``: position interpolation."""

    factor: PositiveFloat = 1.0
    """How many times longer the contexts are than in pretraining."""

    def inverse_frequencies(self, head_size: int) -> np.ndarray:
        return (super().inverse_frequencies(head_size) / np.float32(self.factor)).astype(np.float32)

    def to_hf(self) -> dict:
        return {**super().to_hf(), "factor": self.factor}


class Llama3RotaryConfig(_RotaryBase):
    """Llama 3.1's scaling: low frequencies are interpolated, high ones kept, the band
    between them blended smoothly."""

    type: Literal["llama3"] = "llama3"
    """``llama3``: Llama 3.1's frequency-dependent scaling."""

    theta: PositiveFloat = 500000.0
    """Base wavelength of the rotations (Hugging Face's ``rope_theta``)."""

    factor: PositiveFloat = 8.0
    """Division applied to the lowest frequencies."""

    low_freq_factor: float = 1.0
    """Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are fully interpolated."""

    high_freq_factor: float = 4.0
    """Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are kept as they are."""

    original_max_position_embeddings: PositiveInt = 8192
    """The context length the model was pretrained with."""

    def inverse_frequencies(self, head_size: int) -> np.ndarray:
        inv_freq = super().inverse_frequencies(head_size)
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def to_hf(self) -> dict:
        return {
            **super().to_hf(),
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


class YarnRotaryConfig(_RotaryBase):
    """YaRN (Peng et al., 2023): interpolation ramped by wavelength, plus an attention temperature."""

    type: Literal["yarn"] = "yarn"
    """``yarn``: YaRN scaling."""

    factor: PositiveFloat = 1.0
    """How many times longer the contexts are than in pretraining."""

    original_max_position_embeddings: PositiveInt = 2048
    """The context length the model was pretrained with."""

    beta_fast: float = 32.0
    """Rotations-per-context above which a plane is extrapolated (kept as is)."""

    beta_slow: float = 1.0
    """Rotations-per-context below which a plane is fully interpolated."""

    mscale: float | None = None
    """With ``mscale_all_dim``, shapes the default ``attention_factor`` (DeepSeek's variant)."""

    mscale_all_dim: float | None = None
    """See ``mscale``."""

    attention_factor: float | None = None
    """Multiplier of the cosines and sines; unset derives it from ``factor`` as YaRN does."""

    truncate: bool = True
    """Round the correction range outwards to whole dimensions."""

    def table_scale(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
        return get_mscale(self.factor)

    def inverse_frequencies(self, head_size: int) -> np.ndarray:
        dim, base = head_size, self.theta

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(base)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid dividing by zero
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        pos_freqs = (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)).astype(np.float32)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        keep = 1 - ramp
        return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)

    def to_hf(self) -> dict:
        out = {
            **super().to_hf(),
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }
        # The optional knobs only when they differ from YaRN's defaults (which transformers
        # assumes when they are absent), the way published configs write them.
        optional = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
        fields = type(self).model_fields
        out.update({n: getattr(self, n) for n in optional if getattr(self, n) != fields[n].default})
        return out


RotaryConfig = Annotated[
    Union[DefaultRotaryConfig, LinearRotaryConfig, Llama3RotaryConfig, YarnRotaryConfig],
    Field(discriminator="type"),
]
"""The ``rope:`` section of a model config: one of the scalings above, chosen by ``type``."""

_BY_TYPE = {cls.model_fields["type"].default: cls for cls in RotaryConfig.__origin__.__args__}


def rotary_from_hf(params: dict | None, *, default_theta: float = 10000.0) -> _RotaryBase:
    """Our rotary config from a Hugging Face ``rope_parameters`` (or legacy ``rope_scaling``)
    dictionary. Raises ``ValueError`` for a scaling we do not implement."""
    params = dict(params or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    cls = _BY_TYPE.get(rope_type)
    if cls is None:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {sorted(_BY_TYPE)}")
    theta = params.pop("rope_theta", None) or default_theta
    allowed = {name for name in cls.model_fields if name != "type"}
    kwargs = {k: v for k, v in params.items() if k in allowed and v is not None}
    return cls(theta=theta, **kwargs)


def rotary_tables(rope: _RotaryBase, head_size: int, positions: NamedArray, HeadSize: Axis):
    """``(cos, sin)`` for ``positions`` (any axes, integer), each with ``HeadSize`` appended.

    Follows Hugging Face: angles are computed in float32 and the two halves of the head
    share the same frequencies."""
    inv_freq = jnp.asarray(rope.inverse_frequencies(head_size))
    angles = positions.array.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    axes = (*positions.axes, HeadSize)
    factor = rope.table_scale()
    return hax.named(jnp.cos(angles) * factor, axes), hax.named(jnp.sin(angles) * factor, axes)


def apply_rotary(x: NamedArray, cos: NamedArray, sin: NamedArray, HeadSize: Axis) -> NamedArray:
    """Rotate ``x`` (axes including ``HeadSize`` and the positions of ``cos``/``sin``).

    The result keeps ``x``'s dtype; the tables are cast to it first, as Hugging Face does."""
    half = HeadSize.size // 2
    first, second = x[HeadSize, :half], x[HeadSize, half:]
    rotated = hax.concatenate(HeadSize.name, [-second, first])
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)
