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

    factor: PositiveFloat = 1.0
    """Levanter's ``default`` rotary also takes a ``factor`` (1: no scaling); another value divides
    every frequency by it, as ``linear`` does."""

    def inverse_frequencies(self, head_size: int) -> np.ndarray:
        freqs = super().inverse_frequencies(head_size)
        return freqs if self.factor == 1.0 else (freqs / np.float32(self.factor)).astype(np.float32)

    def to_hf(self) -> dict:
        if self.factor == 1.0:
            return super().to_hf()
        return {"rope_type": "linear", "rope_theta": self.theta, "factor": self.factor}


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


# What transformers reads from ``rope_parameters`` for each rope type we implement, besides
# ``rope_type`` and ``rope_theta``. Other keys do not change its results (it ignores them),
# so they are ignored here too; ``partial_rotary_factor`` is handled on its own.
_HF_ROPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        }
    ),
}

# rope types of transformers that we do not implement, and what they do, for the error message
_HF_UNSUPPORTED_ROPE = {
    "dynamic": "dynamic NTK scaling, which changes the frequencies with the sequence length",
    "longrope": "LongRoPE (Phi-3), per-frequency short and long factors",
    "proportional": "proportional partial rotation",
    "axial": "axial (2-D) rotation",
}


def rotary_from_hf(
    params: dict | None, *, default_theta: float = 10000.0, hf_config: dict | None = None
) -> _RotaryBase:
    """Our rotary config from a Hugging Face ``rope_parameters`` (or legacy ``rope_scaling``)
    dictionary.

    ``hf_config``, the whole ``config.json``, supplies what ``transformers`` reads beside the
    dictionary: a top-level ``partial_rotary_factor``, a top-level
    ``original_max_position_embeddings`` (which takes precedence), and
    ``max_position_embeddings``, the default of ``original_max_position_embeddings`` for
    ``llama3`` and ``yarn`` and of a null YaRN ``factor`` (``max / original``). Pass it
    whenever the dictionary comes from a config file.

    Raises ``ValueError`` naming the setting, for anything that would change the rotation
    and that we do not implement: a rope type other than ``default``, ``linear``, ``llama3``
    and ``yarn``, or a ``partial_rotary_factor`` other than 1 (rotating only part of each
    head), so that an import fails rather than giving wrong logits."""
    hf_config = hf_config or {}
    params = dict(params or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)  # transformers keeps the legacy alias beside rope_type
    if rope_type not in _HF_ROPE_KEYS:
        what = _HF_UNSUPPORTED_ROPE.get(rope_type, "unknown to us")
        raise ValueError(
            f"rope type {rope_type!r} is not supported ({what}); supported: {sorted(_HF_ROPE_KEYS)} "
            "(rope_parameters.rope_type, or rope_scaling.type in older files)"
        )
    for where, partial in (
        ("rope_parameters.partial_rotary_factor", params.pop("partial_rotary_factor", None)),
        ("partial_rotary_factor", hf_config.get("partial_rotary_factor")),
    ):
        if partial is not None and float(partial) != 1.0:
            raise ValueError(
                f"{where} = {partial} is not supported: only rotating every dimension of each head "
                "(partial_rotary_factor 1.0) is implemented"
            )
    theta = params.pop("rope_theta", None) or default_theta
    kwargs = {k: v for k, v in params.items() if k in _HF_ROPE_KEYS[rope_type] and v is not None}
    if "original_max_position_embeddings" in _HF_ROPE_KEYS[rope_type]:
        # transformers' precedence: the top-level key, the dictionary's, then the context length
        candidates = (
            hf_config.get("original_max_position_embeddings"),
            params.get("original_max_position_embeddings"),
            hf_config.get("max_position_embeddings"),
        )
        original = next((c for c in candidates if c is not None), None)
        if original is not None:
            kwargs["original_max_position_embeddings"] = original
    if rope_type == "yarn" and "factor" in params and params["factor"] is None:
        # a null factor means the ratio of the context lengths (DeepSeek-V3's convention)
        if hf_config.get("max_position_embeddings") is None or "original_max_position_embeddings" not in kwargs:
            raise ValueError(
                "rope_parameters.factor is null for yarn, and max_position_embeddings and "
                "original_max_position_embeddings are not both given to derive it from"
            )
        kwargs["factor"] = hf_config["max_position_embeddings"] / kwargs["original_max_position_embeddings"]
    return _BY_TYPE[rope_type](theta=theta, **kwargs)


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
