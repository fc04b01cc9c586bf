"""Normalization layers: RMSNorm (with Gemma's ``1 + weight`` variant) and LayerNorm.

Both compute in float32 whatever the input dtype and return the input's dtype, as the
Hugging Face implementations do. A norm over several axes (OLMo 2 normalizes all query
heads together) stores its weight with those axes and exports it flattened, the shape a
PyTorch checkpoint has.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp
from haliax import AxisSpec, NamedArray
from haliax.state_dict import ModuleWithStateDictSerialization

LayerNorm = hnn.LayerNorm
"""LayerNorm with a learned scale and bias (Haliax's), used by GPT-2 style models."""


class RmsNorm(ModuleWithStateDictSerialization):
    """``x / sqrt(mean(x^2) + eps) * (weight_offset + weight)`` over ``axis``.

    ``weight_offset`` is 0 for Llama-style norms and 1 for Gemma's, whose checkpoints store
    the deviation from 1; keeping the stored value as the parameter makes import and
    export plain copies.
    """

    weight: NamedArray | None
    axis: AxisSpec = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    weight_offset: float = eqx.field(static=True, default=0.0)

    @staticmethod
    def init(axis: AxisSpec, *, eps: float = 1e-6, weight_offset: float = 0.0, use_weight: bool = True) -> RmsNorm:
        # Gemma's stored weights start at 0 (a scale of exactly 1); the others start at 1.
        weight = hax.full(axis, 1.0 - weight_offset) if use_weight else None
        return RmsNorm(weight, axis, eps, weight_offset)

    def __call__(self, x: NamedArray) -> NamedArray:
        in_dtype = x.dtype
        x32 = x.astype(jnp.float32)
        variance = hax.mean(hax.square(x32), axis=self.axis)
        normed = x32 * hax.rsqrt(variance + self.eps)
        if self.weight is None:
            return normed.astype(in_dtype)
        scale = self.weight.astype(jnp.float32) + self.weight_offset
        return (normed * scale).astype(in_dtype)

    def flatten_for_export(self) -> RmsNorm:
        if self.weight is None or self.weight.ndim == 1:
            return self
        flat = hax.flatten_axes(self.weight, self.weight.axes, "__norm__")
        flattened: RmsNorm = eqx.tree_at(lambda m: m.weight, self, flat)
        return flattened

    def unflatten_from_export(self, template: RmsNorm) -> RmsNorm:
        if template.weight is None or template.weight.ndim == 1:
            return self
        assert self.weight is not None  # loaded into the template's structure
        weight = hax.named(self.weight.array.reshape(template.weight.array.shape), template.weight.axes)
        unflattened: RmsNorm = eqx.tree_at(lambda m: m.weight, self, weight)
        return unflattened
