"""Rotary position embeddings (RoPE) and the scalings that stretch them to longer contexts.

The ``rope:`` field of a model config picks one by ``type``::

    rope: {type: default, theta: 10000}
    rope: {type: linear, theta: 10000, factor: 8}
    rope: {type: llama3, theta: 500000, factor: 8, low_freq_factor: 1, high_freq_factor: 4,
           original_max_position_embeddings: 8192}
    rope: {type: yarn, theta: 10000, factor: 4, original_max_position_embeddings: 4096}

    rope: {type: longrope, short_factor: [...], long_factor: [...], original_max_position_embeddings: 4096}
    rope: {type: dynamic, factor: 2, max_position_embeddings: 4096}

Each computes the inverse frequencies of the ``rotary_dim / 2`` rotation planes and a
factor applied to the cosines and sines, with the same arithmetic (in float32) as
Hugging Face's ``modeling_rope_utils``, so imported models give the same logits.
The rotation pairs dimension ``i`` with ``i + rotary_dim / 2`` ("rotate half"), the
layout of Hugging Face checkpoints, so no weights need permuting on import.

Two things the kit's families rely on:

* **Partial rotation**: ``partial_rotary_factor`` (any scaling) rotates only the first
  ``int(head_size * partial_rotary_factor)`` dimensions of each head and passes the rest
  through (Phi-3 mini 128k's successors, GPT-NeoX, StableLM);
* **Scalings that depend on the sequence length**: ``inverse_frequencies`` and
  ``table_scale`` receive the length of the sequence being processed (``seq_len``), as
  Hugging Face's dynamic NTK and LongRoPE need (LongRoPE switches from its short to its
  long factors past ``original_max_position_embeddings``). Attention passes the number of
  positions it sees; a key/value-cached decoder passes the cache's length.
"""

from __future__ import annotations

import math
import typing
from typing import TYPE_CHECKING, Annotated, Any, Literal

import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray
from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from levanter_core.config.base import ConfigModel


class _RotaryBase(ConfigModel):
    if TYPE_CHECKING:
        type: str  # each scaling's own Literal field, the discriminator

    theta: PositiveFloat = 10000.0
    """Base wavelength of the rotations (Hugging Face's ``rope_theta``)."""

    partial_rotary_factor: float = Field(1.0, gt=0.0, le=1.0)
    """Fraction of each head that rotates: the first ``int(head_size * partial_rotary_factor)``
    dimensions; the others pass through unchanged. 1: the whole head."""

    def rotary_dim(self, head_size: int) -> int:
        """How many dimensions of a head of ``head_size`` rotate (even)."""
        dim = int(head_size * self.partial_rotary_factor)
        if dim < 2 or dim % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_size {head_size} rotates {dim} "
                "dimensions; it must be an even number of at least 2"
            )
        return dim

    def inverse_frequencies(self, head_size: int, seq_len: int | None = None) -> np.ndarray:
        """The ``head_size / 2`` angular frequencies (float32) of a rotation over ``head_size``
        dimensions (the rotated part of a head), for a sequence of ``seq_len`` positions
        (None: the context the model was configured for; only some scalings depend on it)."""
        return (
            1.0 / (self.theta ** (np.arange(0, head_size, 2, dtype=np.int64).astype(np.float32) / head_size))
        ).astype(np.float32)

    def table_scale(self, seq_len: int | None = None) -> float:
        """Multiplies the cosines and sines (YaRN's and LongRoPE's attention temperature); 1 for the others."""
        return 1.0

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``rope_parameters`` dictionary of this scaling."""
        out: dict[str, Any] = {"rope_type": self.type, "rope_theta": self.theta}
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        return out


class DefaultRotaryConfig(_RotaryBase):
    """Plain RoPE (Su et al., 2021)."""

    type: Literal["default"] = "default"
    """``default``: no scaling."""

    factor: PositiveFloat = 1.0
    """Levanter's ``default`` rotary also takes a ``factor`` (1: no scaling); another value divides
    every frequency by it, as ``linear`` does."""

    def inverse_frequencies(self, head_size: int, seq_len: int | None = None) -> np.ndarray:
        freqs = super().inverse_frequencies(head_size)
        return freqs if self.factor == 1.0 else (freqs / np.float32(self.factor)).astype(np.float32)

    def to_hf(self) -> dict[str, Any]:
        if self.factor == 1.0:
            return super().to_hf()
        return {**super().to_hf(), "rope_type": "linear", "factor": self.factor}


class LinearRotaryConfig(_RotaryBase):
    """Position interpolation: every frequency divided by ``factor``."""

    type: Literal["linear"] = "linear"
    """``linear``: position interpolation."""

    factor: PositiveFloat = 1.0
    """How many times longer the contexts are than in pretraining."""

    def inverse_frequencies(self, head_size: int, seq_len: int | None = None) -> np.ndarray:
        return (super().inverse_frequencies(head_size) / np.float32(self.factor)).astype(np.float32)

    def to_hf(self) -> dict[str, Any]:
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

    def inverse_frequencies(self, head_size: int, seq_len: int | None = None) -> np.ndarray:
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

    def to_hf(self) -> dict[str, Any]:
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

    def table_scale(self, seq_len: int | None = None) -> float:
        if self.attention_factor is not None:
            return self.attention_factor

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
        return get_mscale(self.factor)

    def inverse_frequencies(self, head_size: int, seq_len: int | None = None) -> np.ndarray:
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
        blended: np.ndarray = (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)
        return blended

    def to_hf(self) -> dict[str, Any]:
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


class LongRopeConfig(_RotaryBase):
    """LongRoPE (Ding et al., 2024; Phi-3): a rescaling factor per rotation plane, one set for
    sequences up to ``original_max_position_embeddings`` and another beyond it, plus an
    attention temperature. Which set applies depends on the sequence length."""

    type: Literal["longrope"] = "longrope"
    """``longrope``: per-plane factors chosen by the sequence length."""

    short_factor: tuple[float, ...]
    """Divisors of the ``rotary_dim / 2`` frequencies for sequences of at most
    ``original_max_position_embeddings`` positions."""

    long_factor: tuple[float, ...]
    """Divisors of the frequencies for longer sequences."""

    original_max_position_embeddings: PositiveInt = 4096
    """The context length the model was pretrained with: the switch from short to long factors."""

    max_position_embeddings: PositiveInt | None = None
    """The extended context length; with ``original_max_position_embeddings`` it gives the
    default ``factor`` (Hugging Face's top-level ``max_position_embeddings``; not exported here)."""

    factor: PositiveFloat | None = None
    """Context extension ratio, for the default ``attention_factor``; None: ``max_position_embeddings
    / original_max_position_embeddings``."""

    attention_factor: float | None = None
    """Multiplier of the cosines and sines; None: ``sqrt(1 + ln(factor) / ln(original))`` (1 when
    ``factor <= 1``)."""

    @model_validator(mode="after")
    def _same_lengths(self) -> LongRopeConfig:
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(
                f"short_factor has {len(self.short_factor)} entries and long_factor {len(self.long_factor)}; "
                "give one per rotation plane (rotary_dim / 2) in each"
            )
        return self

    def _factor(self) -> float:
        if self.factor is not None:
            return self.factor
        if self.max_position_embeddings is None:
            return 1.0
        return self.max_position_embeddings / self.original_max_position_embeddings

    def is_long(self, seq_len: int | None) -> bool:
        """Whether a sequence of ``seq_len`` positions uses the long factors."""
        return seq_len is not None and seq_len > self.original_max_position_embeddings

    def inverse_frequencies(self, head_size: int, seq_len: int | None = None) -> np.ndarray:
        factors = self.long_factor if self.is_long(seq_len) else self.short_factor
        if len(factors) != head_size // 2:
            raise ValueError(
                f"longrope has {len(factors)} factors but the rotation has {head_size // 2} planes "
                f"(rotary dimension {head_size}); give one factor per plane"
            )
        shape = np.arange(0, head_size, 2, dtype=np.int64).astype(np.float32) / head_size
        return (1.0 / (np.asarray(factors, dtype=np.float32) * np.float32(self.theta) ** shape)).astype(np.float32)

    def table_scale(self, seq_len: int | None = None) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        factor = self._factor()
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(self.original_max_position_embeddings))

    def to_hf(self) -> dict[str, Any]:
        out = {
            **super().to_hf(),
            "short_factor": list(self.short_factor),
            "long_factor": list(self.long_factor),
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }
        out.update({n: getattr(self, n) for n in ("factor", "attention_factor") if getattr(self, n) is not None})
        return out


class DynamicRotaryConfig(_RotaryBase):
    """Dynamic NTK scaling: past ``max_position_embeddings`` positions, the base wavelength grows
    with the sequence length; within it, plain RoPE."""

    type: Literal["dynamic"] = "dynamic"
    """``dynamic``: NTK-aware scaling that depends on the sequence length."""

    factor: PositiveFloat = 1.0
    """How strongly the base grows with the length."""

    max_position_embeddings: PositiveInt = 2048
    """The length up to which the rotation is plain RoPE (Hugging Face's top-level
    ``max_position_embeddings``; not exported here)."""

    def inverse_frequencies(self, head_size: int, seq_len: int | None = None) -> np.ndarray:
        length = max(seq_len or self.max_position_embeddings, self.max_position_embeddings)
        ratio = self.factor * length / self.max_position_embeddings - (self.factor - 1)
        base = self.theta * ratio ** (head_size / (head_size - 2))
        shape = np.arange(0, head_size, 2, dtype=np.int64).astype(np.float32) / head_size
        return (1.0 / (np.float32(base) ** shape)).astype(np.float32)

    def to_hf(self) -> dict[str, Any]:
        return {**super().to_hf(), "factor": self.factor}


RotaryConfig = Annotated[
    DefaultRotaryConfig
    | LinearRotaryConfig
    | Llama3RotaryConfig
    | YarnRotaryConfig
    | LongRopeConfig
    | DynamicRotaryConfig,
    Field(discriminator="type"),
]
"""The ``rope:`` section of a model config: one of the scalings above, chosen by ``type``."""

_BY_TYPE: dict[str, type[_RotaryBase]] = {
    cls.model_fields["type"].default: cls for cls in typing.get_args(typing.get_args(RotaryConfig)[0])
}


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
    "longrope": frozenset(
        {"short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"}
    ),
    "dynamic": frozenset({"factor"}),
}

# rope types of transformers that we do not implement, and what they do, for the error message
_HF_UNSUPPORTED_ROPE = {
    "proportional": "proportional partial rotation",
    "axial": "axial (2-D) rotation",
}


def rotary_from_hf(
    params: dict[str, Any] | None, *, default_theta: float = 10000.0, hf_config: dict[str, Any] | None = None
) -> _RotaryBase:
    """Our rotary config from a Hugging Face ``rope_parameters`` (or legacy ``rope_scaling``)
    dictionary.

    ``hf_config``, the whole ``config.json``, supplies what ``transformers`` reads beside the
    dictionary: a top-level ``partial_rotary_factor``, a top-level
    ``original_max_position_embeddings`` (which takes precedence), and
    ``max_position_embeddings``, the default of ``original_max_position_embeddings`` for
    ``llama3``, ``yarn`` and ``longrope``, of a null YaRN ``factor`` (``max / original``), and
    the length past which ``dynamic`` scaling starts. Pass it whenever the dictionary comes
    from a config file.

    Raises ``ValueError`` naming the setting, for a rope type we do not implement, so that an
    import fails rather than giving wrong logits."""
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
    # the dictionary's own value first, as transformers 5 reads it; then the top-level key
    partial = params.pop("partial_rotary_factor", None)
    if partial is None:
        partial = hf_config.get("partial_rotary_factor")
    theta = params.pop("rope_theta", None) or default_theta
    kwargs = {k: v for k, v in params.items() if k in _HF_ROPE_KEYS[rope_type] and v is not None}
    if partial is not None:
        kwargs["partial_rotary_factor"] = float(partial)
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
    if rope_type in ("longrope", "dynamic") and hf_config.get("max_position_embeddings") is not None:
        kwargs["max_position_embeddings"] = hf_config["max_position_embeddings"]
    if rope_type == "yarn" and "factor" in params and params["factor"] is None:
        # a null factor means the ratio of the context lengths (DeepSeek-V3's convention)
        if hf_config.get("max_position_embeddings") is None or "original_max_position_embeddings" not in kwargs:
            raise ValueError(
                "rope_parameters.factor is null for yarn, and max_position_embeddings and "
                "original_max_position_embeddings are not both given to derive it from"
            )
        kwargs["factor"] = hf_config["max_position_embeddings"] / kwargs["original_max_position_embeddings"]
    return _BY_TYPE[rope_type](theta=theta, **kwargs)


def rotary_tables(
    rope: _RotaryBase, head_size: int, positions: NamedArray, HeadSize: Axis, *, seq_len: int | None = None
) -> tuple[NamedArray, NamedArray]:
    """``(cos, sin)`` for ``positions`` (any axes, integer), each with the rotated part of
    ``HeadSize`` appended (all of it unless ``rope.partial_rotary_factor`` < 1).

    ``seq_len``: the length of the sequence being processed, for scalings that depend on it
    (None: the model's configured context). Follows Hugging Face: angles are computed in
    float32 and the two halves of the rotated part share the same frequencies."""
    dim = rope.rotary_dim(head_size)
    inv_freq = jnp.asarray(rope.inverse_frequencies(dim, seq_len=seq_len))
    angles = positions.array.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    axes = (*positions.axes, HeadSize.resize(dim))
    factor = rope.table_scale(seq_len)
    return hax.named(jnp.cos(angles) * factor, axes), hax.named(jnp.sin(angles) * factor, axes)


def apply_rotary(x: NamedArray, cos: NamedArray, sin: NamedArray, HeadSize: Axis) -> NamedArray:
    """Rotate ``x`` (axes including ``HeadSize`` and the positions of ``cos``/``sin``).

    When the tables are narrower than the head (partial rotation), the first
    ``cos``-width dimensions rotate and the rest pass through. The result keeps ``x``'s
    dtype; the tables are cast to it first, as Hugging Face does."""
    dim = cos.resolve_axis(HeadSize.name).size
    if dim < HeadSize.size:
        rotated = apply_rotary(x[HeadSize.name, :dim], cos, sin, HeadSize.resize(dim))
        return hax.concatenate(HeadSize.name, [rotated, x[HeadSize.name, dim:]])
    half = HeadSize.size // 2
    first, second = x[HeadSize, :half], x[HeadSize, half:]
    rotated = hax.concatenate(HeadSize.name, [-second, first])
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)
