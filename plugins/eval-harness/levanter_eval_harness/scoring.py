"""Log-likelihoods of continuations, computed in batches of a few fixed shapes.

A *query* is one model input (token ids) and the tokens it should have predicted at a run of
its positions: lm-eval's ``(context, continuation)`` pair once tokenized and left-truncated, or
one window of a rolling log-likelihood. Its score is the sum of the log-probabilities of those
tokens and whether each of them is the model's most likely one (lm-eval's ``is_greedy``).

Queries are sorted longest first and cut into batches of ``rows`` distinct inputs; queries
whose inputs are identical (the choices of a multiple-choice question whose answers are one
token long, say) share a row, so the model runs over that input once.

For a model with a key/value cache, queries that share a *prefix* (everything before the
first scored position: the context of a multiple-choice question, whatever its answers) share
more: the model runs over each distinct prefix once, filling a cache, and then over each
query's remaining tokens (its answer) from a copy of its prefix's cache row. A multiple-choice
question with four answers then costs one pass over its context instead of four.

A batch's arrays are padded to a few sizes (lengths to powers of two and halfway between,
numbers of queries to powers of two), so that each shape compiles once. Logits are computed only at the scored positions, a block of positions at a
time, in float32.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis

from levanter_core.inference import decoding
from levanter_core.models.lm import soft_cap

SMALLEST_LENGTH = 16
"""The shortest input length bucket (shorter inputs are padded to it)."""

SHARED_QUERIES = 4
"""With shared prefixes, at most this many queries per row of a batch, on average."""


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
    def of_pair(cls, context: Sequence[int], continuation: Sequence[int], max_length: int) -> Query:
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
    suffix: np.ndarray | None = None
    """With shared prefixes: ``[queries, width]`` int32, each query's tokens from its first
    scored position on; ``tokens`` then holds the prefixes, and ``start`` is where each
    query's suffix begins (its prefix's length)."""

    def arrays(self) -> tuple[np.ndarray, ...]:
        shared = () if self.suffix is None else (self.suffix,)
        return self.tokens, self.row, self.start, self.targets, self.mask, *shared


def bucket(n: int, smallest: int, largest: int) -> int:
    """The power of two at or above ``n`` (at least ``smallest``), capped at ``largest``."""
    return min(largest, max(smallest, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


def length_bucket(n: int, smallest: int, largest: int) -> int:
    """The input length ``n`` is padded to: a power of two or one and a half times one
    (16, 24, 32, 48, 64, 96...), at least ``smallest``, at most ``largest``. Inputs fill their
    bucket to 83% on average instead of 75% for powers of two alone: less computation spent on
    padding, for twice as many shapes to compile."""
    power = bucket(n, smallest, largest)
    three_quarters = power * 3 // 4
    if power >= 4 * 2 and n <= three_quarters and three_quarters >= smallest:
        return three_quarters
    return power


def plan_batches(queries: Sequence[Query], rows: int, max_length: int, *, share_prefixes: bool = False) -> list[Batch]:
    """``queries`` in batches of at most ``rows`` distinct inputs (``share_prefixes``: distinct
    prefixes, for a model with a cache), longest first. A batch of prefixes that no two queries
    share is planned as one of whole inputs."""
    for i, q in enumerate(queries):
        if not q.targets:
            raise ValueError(f"query {i} has no tokens to score")
        if len(q.tokens) > max_length:
            raise ValueError(f"query {i} has {len(q.tokens)} input tokens, more than the context ({max_length})")
        if q.start < 0 or q.start + len(q.targets) > len(q.tokens):
            raise ValueError(f"query {i}: its targets do not fit its input")
        if share_prefixes and q.start + len(q.targets) != len(q.tokens):
            raise ValueError(f"query {i}: with shared prefixes, the targets must be scored up to the input's end")
    if share_prefixes:
        prefix = [q.tokens[: q.start] for q in queries]
        # Each query of a batch gets a copy of its prefix's cache row: at most SHARED_QUERIES
        # times as many queries as rows keeps that memory to a few batches' caches.
        groups = _group(
            range(len(queries)), prefix, lambda i: (-len(queries[i].tokens), queries[i].tokens), rows,
            max_queries=SHARED_QUERIES * rows,
        )  # fmt: skip
        # A batch where sharing prefixes saves nothing over sharing whole inputs (rolling
        # windows; one-token answers, whose queries of a prefix have one input) runs as whole
        # inputs: no cache to fill and copy.
        return [
            _pad(queries, group, rows, max_length)
            if all(len({queries[i].tokens for i in members}) == 1 for members in group)
            else _pad(queries, group, rows, max_length, prefixed=True)
            for group in groups
        ]
    groups = _group(range(len(queries)), [q.tokens for q in queries], lambda i: queries[i].tokens, rows)
    return [_pad(queries, group, rows, max_length) for group in groups]


def _group(indices, keys, then, rows: int, max_queries: int | None = None) -> list[list[list[int]]]:
    """``indices`` sorted by (longest ``keys`` first, ``then``) and cut into batches of at most
    ``rows`` rows (and ``max_queries`` indices), each row the indices of one distinct key."""
    order = sorted(indices, key=lambda i: (-len(keys[i]), keys[i], then(i)))
    groups: list[list[list[int]]] = []
    for i in order:
        if groups and max_queries is not None and sum(map(len, groups[-1])) >= max_queries:
            groups.append([[i]])
        elif groups and groups[-1] and keys[groups[-1][-1][0]] == keys[i]:
            groups[-1][-1].append(i)
        elif groups and len(groups[-1]) < rows:
            groups[-1].append([i])
        else:
            groups.append([[i]])
    return groups


def _pad(
    queries: Sequence[Query], group: list[list[int]], rows: int, max_length: int, *, prefixed: bool = False
) -> Batch:
    """The arrays of one batch. Each row holds the input its queries share, whole, or with
    ``prefixed`` only the prefix before their scored tokens (which go to ``suffix``)."""
    shared = (lambda q: q.tokens[: q.start]) if prefixed else (lambda q: q.tokens)
    longest = max(len(shared(queries[r[0]])) for r in group)
    length = length_bucket(longest, min(SMALLEST_LENGTH, max_length), max_length)
    indices = [i for r in group for i in r]
    width = bucket(max(len(queries[i].targets) for i in indices), 1, max_length if prefixed else length)
    count = bucket(len(indices), 1, 1 << 30)
    tokens = np.zeros((rows, length), np.int32)
    row = np.zeros(count, np.int32)
    start = np.zeros(count, np.int32)
    targets = np.zeros((count, width), np.int32)
    mask = np.zeros((count, width), bool)
    suffix = np.zeros((count, width), np.int32) if prefixed else None
    k = 0
    for r, members in enumerate(group):
        first = shared(queries[members[0]])
        tokens[r, : len(first)] = first
        for i in members:
            q = queries[i]
            row[k], start[k] = r, q.start
            targets[k, : len(q.targets)] = q.targets
            mask[k, : len(q.targets)] = True
            if suffix is not None:
                suffix[k, : len(q.targets)] = q.tokens[q.start :]
            k += 1
    return Batch(indices, tokens, row, start, targets, mask, suffix)


def continuation_scores(model, tokens, row, start, targets, mask, *, block_logits: int):
    """Per query, the summed log-probability of its targets and whether every one of them is
    the most likely token at its position: two arrays ``[queries]`` (float32, bool). ``tokens``
    is a named array ``(batch, position)``; the rest are plain arrays as in :class:`Batch`.
    At most ``block_logits`` logits exist at a time."""
    Embed = model.config.Embed.name
    hidden = model.activations(tokens).rearrange(("batch", "position", Embed)).array
    length, width = hidden.shape[1], targets.shape[1]
    positions = jnp.clip(start[:, None] + jnp.arange(width)[None, :], 0, length - 1)
    picked = hidden[row[:, None], positions]  # [queries, width, embed]
    return _scores(model, picked, targets, mask, block_logits)


def prefixed_scores(model, prefixes, row, start, targets, mask, suffix, *, block_logits: int):
    """:func:`continuation_scores` of a batch with shared prefixes (``prefixes`` a named array
    ``(batch, position)``, ``suffix`` ``[queries, width]``): each prefix runs through the model
    into a key/value cache once; each query's suffix then runs from its prefix's cache row."""
    Rows, Pos = prefixes.axes
    width = suffix.shape[1]
    KeyPos = Axis("key_position", Pos.size + width)
    cache = decoding.init_cache(model, Rows, KeyPos)
    positions = hax.broadcast_to(hax.arange(Pos), (Rows, Pos))
    _, cache = decoding.decode(model, prefixes, positions, cache, key_len=Pos.size)
    cache = _take_rows(cache, hax.named(jnp.asarray(row), "batch"))
    Queries, Width = Axis("batch", suffix.shape[0]), Axis("position", width)
    where = hax.named(jnp.asarray(start)[:, None] + jnp.arange(width)[None, :], (Queries, Width))
    hidden, _ = decoding.decode(
        model, hax.named(jnp.asarray(suffix), (Queries, Width)), where, cache, key_len=KeyPos.size
    )
    picked = hidden.rearrange(("batch", "position", model.config.Embed.name)).array
    return _scores(model, picked, targets, mask, block_logits)


def _take_rows(cache, index):
    """``cache`` with row ``index[i]`` as its row ``i`` (every named array with a ``batch`` axis)."""

    def take(x):
        if isinstance(x, hax.NamedArray) and x.has_axis("batch"):
            return hax.take(x, "batch", index)
        return x

    return jax.tree.map(take, cache, is_leaf=lambda x: isinstance(x, hax.NamedArray))


def _scores(model, picked, targets, mask, block_logits: int):
    """Per query, the summed log-probability of its targets and whether each is the most likely
    token, from the final hidden states ``picked`` ``[queries, width, embed]`` at the scored
    positions."""
    head = model.get_lm_head().rearrange((model.config.Embed.name, model.Vocab.name)).array
    cap = getattr(model.config, "final_logit_soft_cap", None)
    width = targets.shape[1]
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
