"""Greedy transcription with a Whisper model, and word error rate.

:func:`greedy_transcribe` encodes a batch of spectrograms once, feeds the decoder its prompt
tokens, then one token per step (the most likely one) through the cross-attention cache, until
every row has produced the end token or ``max_tokens`` tokens. Two programs are compiled: the
prompt's and the one-token step (the same for every step).
"""

from __future__ import annotations

from typing import Sequence

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import Axis


def greedy_transcribe(
    model, features: np.ndarray, *, prompt: Sequence[int], end_id: int, max_tokens: int
) -> list[list[int]]:
    """For each row of ``features`` (log-mel spectrograms ``[rows, mels, frames]``), the token
    ids the model reads after ``prompt`` (greedy), without the end token ``end_id``, at most
    ``max_tokens`` of them."""
    if not prompt:
        raise ValueError("the decoder needs at least one prompt token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    config = model.config
    Batch = Axis("batch", features.shape[0])
    spectrograms = hax.named(jnp.asarray(features, jnp.float32), (Batch, config.Mels.name, config.Frames.name))
    total = len(prompt) + max_tokens
    if total > config.seq_len:
        raise ValueError(f"{len(prompt)} prompt tokens and {max_tokens} new ones exceed the decoder's {config.seq_len} positions")
    cache = _start(model, spectrograms, total)
    tokens = hax.named(jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (Batch.size, len(prompt))), (Batch, "position"))
    positions = hax.named(jnp.broadcast_to(jnp.arange(len(prompt), dtype=jnp.int32), tokens.array.shape), (Batch, "position"))
    out = np.zeros((Batch.size, max_tokens), np.int64)
    done = np.zeros(Batch.size, bool)
    for t in range(max_tokens):
        chosen, cache = _step(model, tokens, positions, cache, key_len=total)
        out[:, t] = np.asarray(chosen)
        done |= out[:, t] == end_id
        if done.all():
            break
        tokens = hax.named(jnp.asarray(out[:, t : t + 1], jnp.int32), (Batch, "position"))
        positions = hax.named(jnp.full((Batch.size, 1), len(prompt) + t, jnp.int32), (Batch, "position"))
    texts = []
    for row in out[:, : t + 1]:
        ids = row.tolist()
        texts.append(ids[: ids.index(end_id)] if end_id in ids else ids)
    return texts


@eqx.filter_jit
def _start(model, spectrograms, total: int):
    return model.init_decoder_cache(model.encode(spectrograms), Axis("key_position", total))


@eqx.filter_jit
def _step(model, tokens, positions, cache, *, key_len: int):
    """The most likely token after the last of ``tokens``, per row, and the updated cache."""
    hidden, cache = model.decode_step(tokens, positions, cache, key_len=key_len)
    last = hidden["position", -1]
    logits = hax.dot(last, model.get_lm_head(), axis="embed")
    return hax.argmax(logits, axis=model.Vocab).array, cache


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Word error rate of ``hypotheses`` against ``references`` (``jiwer``): substituted,
    deleted and inserted words over the references' words."""
    import jiwer

    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    return float(jiwer.wer(list(references), list(hypotheses)))
