"""Log-likelihoods of continuations, computed in batches of a few fixed shapes.

A *query* is one model input (token ids) and the tokens it should have predicted at a run of
its positions: lm-eval's ``(context, continuation)`` pair once tokenized and left-truncated, or
one window of a rolling log-likelihood. Its score is the sum of the log-probabilities of those
tokens and whether each of them is the model's most likely one (lm-eval's ``is_greedy``).

Queries are sorted longest first and cut into batches of ``rows`` distinct inputs; queries
whose inputs are identical (the choices of a multiple-choice question whose answers are one
token long, say) share a row, so the model runs over that input once. A batch's arrays are
padded to powers of two (input length, continuation length, number of queries), so that each
shape compiles once. Logits are computed only at the scored positions, a block of positions
at a time, in float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

SMALLEST_LENGTH = 16
"""The shortest input length bucket (shorter inputs are padded to it)."""


@dataclasses.dataclass(frozen=True)
class Query:
    """One model input and the tokens it is scored on."""

    tokens: tuple[int, ...]
    """The input ids (at most the model's context)."""
    start: int
    """The first scored position: the prediction made at ``tokens[start]`` is scored against
    ``targets[0]``, the one at ``tokens[start + 1]`` against ``targets[1]``, and so on."""
    targets: tuple[int, ...]

    @classmethod
    def of_pair(cls, context: Sequence[int], continuation: Sequence[int], max_length: int) -> "Query":
        """The query of a tokenized ``(context, continuation)`` as lm-eval's ``hf`` backend builds
        it: the two joined, cut from the left to ``max_length + 1`` tokens, the last one dropped
        (it predicts nothing)."""
        whole = (list(context) + list(continuation))[-(max_length + 1) :]
        tokens = tuple(whole[:-1])
        return cls(tokens, len(tokens) - len(continuation), tuple(continuation))


@dataclasses.dataclass
class Batch:
    """The padded arrays of one batch, and which queries they hold (in array order)."""

    indices: list[int]
    tokens: np.ndarray
    """``[rows, length]`` int32 input ids."""
    row: np.ndarray
    """``[queries]`` int32: the row of each query's input."""
    start: np.ndarray
    """``[queries]`` int32: each query's first scored position."""
    targets: np.ndarray
    """``[queries, width]`` int32 target ids."""
    mask: np.ndarray
    """``[queries, width]`` bool: which targets are real (the rest is padding)."""

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.tokens, self.row, self.start, self.targets, self.mask


def bucket(n: int, smallest: int, largest: int) -> int:
    """The power of two at or above ``n`` (at least ``smallest``), capped at ``largest``."""
    return min(largest, max(smallest, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


def plan_batches(queries: Sequence[Query], rows: int, max_length: int) -> list[Batch]:
    """``queries`` in batches of at most ``rows`` distinct inputs, longest inputs first."""
    for i, q in enumerate(queries):
        if not q.targets:
            raise ValueError(f"query {i} has no tokens to score")
        if len(q.tokens) > max_length:
            raise ValueError(f"query {i} has {len(q.tokens)} input tokens, more than the context ({max_length})")
        if q.start < 0 or q.start + len(q.targets) > len(q.tokens):
            raise ValueError(f"query {i}: its targets do not fit its input")
    order = sorted(range(len(queries)), key=lambda i: (-len(queries[i].tokens), queries[i].tokens))
    groups: list[list[list[int]]] = []  # batches of rows of query indices
    for i in order:
        if groups and groups[-1] and queries[groups[-1][-1][0]].tokens == queries[i].tokens:
            groups[-1][-1].append(i)
        elif groups and len(groups[-1]) < rows:
            groups[-1].append([i])
        else:
            groups.append([[i]])
    return [_pad(queries, group, rows, max_length) for group in groups]


def _pad(queries: Sequence[Query], group: list[list[int]], rows: int, max_length: int) -> Batch:
    longest = max(len(queries[r[0]].tokens) for r in group)
    length = bucket(longest, min(SMALLEST_LENGTH, max_length), max_length)
    indices = [i for r in group for i in r]
    width = bucket(max(len(queries[i].targets) for i in indices), 1, length)
    count = bucket(len(indices), 1, 1 << 30)
    tokens = np.zeros((rows, length), np.int32)
    row = np.zeros(count, np.int32)
    start = np.zeros(count, np.int32)
    targets = np.zeros((count, width), np.int32)
    mask = np.zeros((count, width), bool)
    k = 0
    for r, members in enumerate(group):
        first = queries[members[0]].tokens
        tokens[r, : len(first)] = first
        for i in members:
            q = queries[i]
            row[k], start[k] = r, q.start
            targets[k, : len(q.targets)] = q.targets
            mask[k, : len(q.targets)] = True
            k += 1
    return Batch(indices, tokens, row, start, targets, mask)


def continuation_scores(model, tokens, row, start, targets, mask, *, block_logits: int):
    """Per query, the summed log-probability of its targets and whether every one of them is
    the most likely token at its position: two arrays ``[queries]`` (float32, bool). ``tokens``
    is a named array ``(batch, position)``; the rest are plain arrays as in :class:`Batch`.
    At most ``block_logits`` logits exist at a time."""
    import jax
    import jax.numpy as jnp

    from levanter_core.models.lm import soft_cap

    Embed = model.config.Embed.name
    hidden = model.activations(tokens).rearrange(("batch", "position", Embed)).array
    head = model.get_lm_head().rearrange((Embed, model.Vocab.name)).array
    cap = getattr(model.config, "final_logit_soft_cap", None)
    length, width = hidden.shape[1], targets.shape[1]
    positions = jnp.clip(start[:, None] + jnp.arange(width)[None, :], 0, length - 1)
    picked = hidden[row[:, None], positions]  # [queries, width, embed]
    count = picked.shape[0] * width
    flat_h = picked.reshape(count, -1)
    flat_t = targets.reshape(count)

    def one_block(h, t):
        logits = soft_cap(jnp.dot(h, head, preferred_element_type=jnp.float32), cap)
        lse = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        return chosen - lse, jnp.argmax(logits, axis=-1) == t

    per_block = max(1, min(count, block_logits // model.Vocab.size))
    blocks = -(-count // per_block)
    if blocks == 1:
        logprobs, greedy = one_block(flat_h, flat_t)
    else:
        pad = blocks * per_block - count
        flat_h = jnp.pad(flat_h, ((0, pad), (0, 0))).reshape(blocks, per_block, -1)
        flat_t = jnp.pad(flat_t, (0, pad)).reshape(blocks, per_block)
        logprobs, greedy = jax.lax.map(lambda xs: one_block(*xs), (flat_h, flat_t))
        logprobs, greedy = logprobs.reshape(-1)[:count], greedy.reshape(-1)[:count]
    logprobs = logprobs.reshape(mask.shape)
    greedy = greedy.reshape(mask.shape)
    return jnp.sum(jnp.where(mask, logprobs, 0.0), axis=1), jnp.all(greedy | ~mask, axis=1)
