"""The one interface the engine decodes through, whatever the model.

A model with a key/value cache offers two methods (the decoder kit's families and GPT-2
have them; a plugin's own model can add them):

* ``init_cache(Batch, KeyPos)``: an empty cache for ``Batch`` sequences of up to
  ``KeyPos.size`` tokens (e.g. a :class:`~levanter_core.inference.cache.KvCache`);
* ``decode(input_ids, positions, cache, *, key_len)``: the final hidden states of new tokens
  ``input_ids`` ``(batch, position)`` sitting at ``positions`` (same axes), attending over the
  cache's first ``key_len`` positions, and the cache with the new tokens in it.

Any other causal language model (one with ``activations`` and ``get_lm_head``) decodes by
running over its whole sequence at every step (:class:`TokenHistory`): correct, slower.
"""

from __future__ import annotations

import logging

import haliax as hax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from levanter_core.errors import UserError
from levanter_core.inference.cache import TokenHistory
from levanter_core.models.lm import soft_cap

logger = logging.getLogger(__name__)


def has_cache(model) -> bool:
    """Whether ``model`` decodes with a cache of its own (``init_cache`` and ``decode``)."""
    return callable(getattr(model, "init_cache", None)) and callable(getattr(model, "decode", None))


def check_can_generate(model, name: str) -> None:
    """Refuse, by the model type's ``name``, a model that cannot generate text at all."""
    if has_cache(model):
        return
    missing = [m for m in ("activations", "get_lm_head") if not callable(getattr(model, m, None))]
    if missing:
        raise UserError(
            f"model type {name!r} cannot generate text: its model has neither a key/value cache "
            f"(init_cache and decode) nor {' and '.join(missing)} to run over the sequence so far"
        )
    logger.warning(
        "model type %r has no key/value cache: each generated token runs the model over the whole "
        "sequence so far (correct, but slower than a family with init_cache and decode)",
        name,
    )


def init_cache(model, Batch: Axis, KeyPos: Axis):
    return model.init_cache(Batch, KeyPos) if has_cache(model) else TokenHistory.zeros(Batch, KeyPos)


def decode(model, input_ids: NamedArray, positions: NamedArray, cache, *, key_len: int):
    """Final hidden states ``(batch, position, embed)`` of the new tokens, and the new cache."""
    if not isinstance(cache, TokenHistory):
        return model.decode(input_ids, positions, cache, key_len=key_len)
    cache = cache.write(input_ids, positions)
    seen = cache.tokens["key_position", :key_len].rename({"key_position": "position"})
    hidden = model.activations(seen).rearrange((cache.Batch.name, "position", ...))
    where = jnp.clip(positions.rearrange((cache.Batch.name, "position")).array, 0, key_len - 1)
    picked = jnp.take_along_axis(hidden.array, where[:, :, None], axis=1)
    return hax.named(picked, (cache.Batch, positions.resolve_axis("position"), *hidden.axes[2:])), cache


def next_token_logits(model, hidden: NamedArray) -> NamedArray:
    """Float32 logits of the next token from final hidden states (soft-capped where the model is)."""
    logits = hax.dot(hidden, model.get_lm_head(), axis=model.config.Embed.name).astype(jnp.float32)
    return soft_cap(logits, getattr(model.config, "final_logit_soft_cap", None))
