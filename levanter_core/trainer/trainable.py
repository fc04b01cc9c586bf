"""Which parts of a model the optimizer trains (:func:`trainable`), and whether a model's linear
layers are quantized."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax

from levanter_core import lora


def _is_overwrite(x) -> bool:
    return isinstance(x, hax.quantization.OverwriteWithGradient)


def is_quantized(model) -> bool:
    return any(_is_overwrite(x) for x in jax.tree.leaves(model, is_leaf=_is_overwrite))


def trainable(model):
    """The parameters the optimizer updates: every floating-point array, except the state of
    quantized layers (FP8 scales), which the step replaces instead of updating; in a model with
    LoRA adapters (:mod:`levanter_core.lora`), the adapters alone."""
    if lora.has_adapters(model):
        return lora.adapter_params(model)
    params = eqx.filter(model, eqx.is_inexact_array)
    if not is_quantized(model):
        return params
    return eqx.filter(params, lambda x: not _is_overwrite(x), is_leaf=_is_overwrite)
