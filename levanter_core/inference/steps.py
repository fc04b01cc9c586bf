"""The inference engine's compiled steps: the prefill of a batch of prompts into their slots of
the key/value cache, and a call of several decoding rounds over every slot; with the shape
buckets they are compiled for and the host side of their outputs (see
:mod:`levanter_core.inference.engine`)."""

from __future__ import annotations

import math

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis

from levanter_core.inference import decoding
from levanter_core.inference.sampling import choose_tokens, token_keys, top_tokens


def _bucket(n: int, smallest: int, largest: int) -> int:
    return min(largest, max(smallest, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


def _sampling(requests) -> bool:
    """Whether a step draws random numbers: a greedy batch runs a program that draws none."""
    return any(r.params.temperature > 0 for r in requests)


def _host(values, *shape):
    """A compiled step's alternatives on the host; an empty ``[*shape, 0]`` array when it computed none."""
    return np.zeros((*shape, 0)) if values is None else np.asarray(values)


# -- the compiled steps ------------------------------------------------------------------------------
@hax.named_jit(donate_args=(True,) + (False,) * 10)
def _prefill(
    cache, model, tokens, lengths, slots, temperature, top_k, top_p, seeds, samples, encoder_inputs,
    *, key_positions, top_n, sample,
):  # fmt: skip
    """Prompts ``tokens`` ``[rows, length]`` (``lengths`` long) through the model into a fresh
    cache whose rows go to ``slots`` of ``cache``; the first generated token of each, its
    log-probability, and the ``top_n`` most likely tokens and their log-probabilities. An
    encoder-decoder's fresh rows start from ``encoder_inputs`` ``[rows, *encoder_input_axes]``
    (None for a language model)."""
    Batch, Pos = Axis("batch", tokens.shape[0]), Axis("position", tokens.shape[1])
    ids = hax.named(jnp.asarray(tokens), (Batch, Pos))
    positions = hax.broadcast_to(hax.arange(Pos), (Batch, Pos))
    if encoder_inputs is not None:
        encoder_inputs = hax.named(jnp.asarray(encoder_inputs), (Batch, *model.encoder_input_axes))
    fresh = decoding.init_cache(model, Batch, key_positions, encoder_inputs)
    hidden, fresh = decoding.decode(model, ids, positions, fresh, key_len=Pos.size)
    hidden = hidden.rearrange((Batch.name, Pos.name, ...))
    last = hax.named(hidden.array[jnp.arange(Batch.size), lengths - 1], (Batch, *hidden.axes[2:]))
    logits = decoding.next_token_logits(model, last).rearrange((Batch.name, ...)).array
    keys = token_keys(seeds, samples, lengths)
    new, logprobs = choose_tokens(logits, temperature, top_k, top_p, keys, sample=sample)
    top_ids, top_lps = top_tokens(logits, top_n) if top_n else (None, None)  # no zero-sized buffers
    return cache.insert(slots, fresh), new, logprobs, top_ids, top_lps


@hax.named_jit(donate_args=(True,) + (False,) * 8)
def _decode(
    cache, model, tokens, positions, temperature, top_k, top_p, seeds, samples, *, key_len, rounds, top_n, sample
):
    """``rounds`` decoding steps of every row: each feeds its last token at its position and
    chooses the next. Returns the cache, the chosen tokens and log-probabilities ``[rows, rounds]``,
    and the ``top_n`` most likely tokens and their log-probabilities ``[rows, rounds, top_n]``."""
    Batch, One = Axis("batch", tokens.shape[0]), Axis("position", 1)

    def step(i, carry):
        cache, tokens, positions, out = carry
        ids = hax.named(tokens[:, None], (Batch, One))
        where = hax.named(positions[:, None], (Batch, One))
        hidden, cache = decoding.decode(model, ids, where, cache, key_len=key_len)
        logits = decoding.next_token_logits(model, hidden["position", 0]).rearrange((Batch.name, ...)).array
        keys = token_keys(seeds, samples, positions + 1)
        new, logprobs = choose_tokens(logits, temperature, top_k, top_p, keys, sample=sample)
        chosen = (new, logprobs, *top_tokens(logits, top_n)) if top_n else (new, logprobs)
        out = tuple(o.at[:, i].set(c) for o, c in zip(out, chosen))
        return cache, new, positions + 1, out

    rows = Batch.size
    out: tuple[jax.Array, ...] = (jnp.zeros((rows, rounds), jnp.int32), jnp.zeros((rows, rounds), jnp.float32))
    if top_n:  # (no zero-sized buffers when nobody asked for alternatives)
        out += (jnp.zeros((rows, rounds, top_n), jnp.int32), jnp.zeros((rows, rounds, top_n), jnp.float32))
    tokens, positions = jnp.asarray(tokens), jnp.asarray(positions)
    cache, _, _, out = jax.lax.fori_loop(0, rounds, step, (cache, tokens, positions, out))
    return (cache, *out) if top_n else (cache, *out, None, None)
