"""The one interface the engine decodes through, whatever the model.

A model with a key/value cache offers two methods (the decoder kit's families and GPT-2
have them; a plugin's own model can add them):

* ``init_cache(Batch, KeyPos)``: an empty cache for ``Batch`` sequences of up to
  ``KeyPos.size`` tokens (e.g. a :class:`~levanter_core.layers.kv_cache.KvCache`);
* ``decode(input_ids, positions, cache, *, key_len)``: the final hidden states of new tokens
  ``input_ids`` ``(batch, position)`` sitting at ``positions`` (same axes), attending over the
  cache's first ``key_len`` positions, and the cache with the new tokens in it.

Any other causal language model (one with ``activations`` and ``get_lm_head``) decodes by
running over its whole sequence at every step (:class:`TokenHistory`): correct, slower.

An **encoder-decoder** (speech recognition, translation) decodes through the same slots, each
request carrying an *encoder input* (Whisper's: a log-mel spectrogram). Its model offers:

* ``encoder_input_axes``: the axes of one request's encoder input (Whisper's ``(mels,
  frames)``), all of them fixed: the engine's shared cache has room for exactly that input;
  ``encoder_input_dtype`` (optional; default float32) its dtype;
* ``start_decoding(encoder_input, KeyPos)``: a cache for the rows of ``encoder_input``
  ``(batch, *encoder_input_axes)``, holding what the encoder made of each and no token yet,
  with room for ``KeyPos.size`` tokens. The cache has ``insert(rows, other)`` (as
  :meth:`KvCache.insert`), which puts all of another such cache's rows at ``rows``;
* ``decode_step(input_ids, positions, cache, *, key_len)``: what ``decode`` above is to a
  language model, the cache also holding each row's encoder output;
* ``get_lm_head`` and ``config.Embed``, as any model the engine decodes.

Nothing here names a model: whatever has the three names decodes as an encoder-decoder.
"""

from __future__ import annotations

import logging

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from levanter_core.errors import UserError
from levanter_core.inference.cache import TokenHistory
from levanter_core.models.lm import soft_cap

logger = logging.getLogger(__name__)


def has_cache(model) -> bool:
    """Whether ``model`` decodes with a cache of its own (``init_cache`` and ``decode``)."""
    return callable(getattr(model, "init_cache", None)) and callable(getattr(model, "decode", None))


def is_encoder_decoder(model) -> bool:
    """Whether ``model`` decodes from an encoder input (``encoder_input_axes``, ``start_decoding``
    and ``decode_step``; see the module docstring)."""
    return (
        getattr(model, "encoder_input_axes", None) is not None
        and callable(getattr(model, "start_decoding", None))
        and callable(getattr(model, "decode_step", None))
    )


def encoder_input_dtype(model):
    """The dtype an encoder-decoder's encoder inputs are given in (float32 unless it says)."""
    return jnp.dtype(getattr(model, "encoder_input_dtype", jnp.float32))


def check_can_generate(model, name: str) -> None:
    """Refuse, by the model type's ``name``, a model that cannot generate text at all."""
    if is_encoder_decoder(model) or has_cache(model):
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


def init_cache(model, Batch: Axis, KeyPos: Axis, encoder_input: NamedArray | None = None):
    """A cache for ``Batch`` new sequences of up to ``KeyPos.size`` tokens; for an encoder-decoder,
    started from their ``encoder_input`` ``(batch, *encoder_input_axes)`` (without one, the
    model is asked for a text-only cache, which it may refuse with a message of its own)."""
    if encoder_input is not None:
        return model.start_decoding(encoder_input, KeyPos)
    return model.init_cache(Batch, KeyPos) if has_cache(model) else TokenHistory.zeros(Batch, KeyPos)


def slot_cache(model, Batch: Axis, KeyPos: Axis):
    """The cache an engine keeps for ``Batch`` slots: :func:`init_cache`'s for a language model;
    for an encoder-decoder, zeros in the shapes ``start_decoding`` gives (a request's prefill puts
    its own row in before anything reads it), made without running the encoder."""
    if not is_encoder_decoder(model):
        return init_cache(model, Batch, KeyPos)
    inputs = jax.ShapeDtypeStruct(
        tuple(ax.size for ax in (Batch, *model.encoder_input_axes)), encoder_input_dtype(model)
    )
    shapes = eqx.filter_eval_shape(
        lambda m, x: m.start_decoding(hax.named(x, (Batch, *m.encoder_input_axes)), KeyPos), model, inputs
    )
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def decode(model, input_ids: NamedArray, positions: NamedArray, cache, *, key_len: int):
    """Final hidden states ``(batch, position, embed)`` of the new tokens, and the new cache."""
    if is_encoder_decoder(model):
        return model.decode_step(input_ids, positions, cache, key_len=key_len)
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
