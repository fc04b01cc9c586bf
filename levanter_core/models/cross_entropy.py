"""The language-modelling loss, fused with the output projection and computed in blocks of tokens.

The logits of a batch (``tokens x vocab``, 134 MB for 4,096 tokens of an 8,192-token
vocabulary in float32) are the largest array of a small model's step, and the plain
computation writes them, reads them back for the log-sum-exp, again for the softmax of the
backward pass, and again transposed for the head's gradient. Here the tokens are cut into
blocks of ``block`` positions; for each block the logits are computed, turned into the loss
*and* the gradients of the loss (with respect to the hidden states and to the head), and
dropped. The gradients are ready at the end of the forward pass, so the backward pass only
scales them. One block's logits are ever held, and the step does the three matmuls of the head
and none of the round trips (on the 2-core reference machine the loss and its gradients take
0.32 s instead of 0.43 s).

The gradient is that of the weighted *sum* of per-token losses; callers divide by the weight
total outside. Arrays are plain JAX arrays: ``hidden [rows, positions, embed]``,
``head [embed, vocab]``, ``targets`` and ``weights [rows, positions]``. Blocks run along the
positions, so every block holds every row: a batch split across devices stays split.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import overload

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray


@dataclasses.dataclass(frozen=True)
class RowShards:
    """The rows of a batch split over ``count`` devices, in order (``count`` equal runs of rows),
    and ``place``, which lays out an array whose leading axis has one entry per shard with that
    entry on its shard's devices.

    The head's gradient is then summed per shard across the blocks, each device its own rows',
    and over the shards once at the end; without it, each block's contribution is a sum over
    every device's rows, and XLA reduces it across the devices block by block (one all-reduce of
    the whole ``embed x vocab`` gradient per block: 32 of 2 GB a step for Llama 3's vocabulary
    on 8 devices)."""

    count: int
    place: Callable[[jax.Array], jax.Array]


def cross_entropy_sum(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    block: int | None = None,
    cap: float | None = None,
    shards: RowShards | None = None,
) -> jax.Array:
    """``sum(weights * (logsumexp(logits) - logits[target]))`` with ``logits = hidden @ head``
    (soft-capped as ``cap * tanh(logits / cap)`` when ``cap`` is set), in float32.
    ``block``: positions per block (None: all of them, one block). ``shards``: how the rows are
    split over devices (:class:`RowShards`; None: not split, or not said)."""
    return _fused(block, cap, 0.0, shards, hidden, head, targets, weights.astype(jnp.float32))[0]


def cross_entropy_and_z_sum(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    z_weight: float,
    block: int | None = None,
    cap: float | None = None,
    shards: RowShards | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(sum(weights * (loss + z_weight * logsumexp(logits)^2)), sum(weights * logsumexp^2))``: the
    cross-entropy with PaLM's z-loss added, and the z-loss term alone (for logging; it has no
    gradient of its own, differentiate the first value)."""
    total, z_sum = _fused(block, cap, float(z_weight), shards, hidden, head, targets, weights.astype(jnp.float32))
    return total, jax.lax.stop_gradient(z_sum)


def token_losses(
    hidden: jax.Array, head: jax.Array, targets: jax.Array, *, block: int | None = None, cap: float | None = None
) -> jax.Array:
    """The per-token losses ``[rows, positions]`` (float32), block by block, without gradients."""
    blocks = _blocks(hidden.shape[1], block)
    h, t = _split(hidden, blocks), _split(targets, blocks)
    per_block = jax.lax.map(lambda xs: _block_losses(xs[0], head, xs[1], cap)[0], (h, t))
    return _join(per_block, *hidden.shape[:2])


def sample_tokens(
    hidden: jax.Array, head: jax.Array, key: jax.Array, *, block: int | None = None, cap: float | None = None
) -> jax.Array:
    """Token ids ``[rows, positions]`` drawn from ``softmax(hidden @ head)`` (soft-capped as the
    loss is), block by block so that the whole batch's logits are never held at once, without
    gradients."""
    hidden, head = jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(head)
    blocks = _blocks(hidden.shape[1], block)
    h = _split(hidden, blocks)
    keys = jax.random.split(key, h.shape[0])
    per_block = jax.lax.map(lambda xs: jax.random.categorical(xs[1], _logits(xs[0], head, cap)), (h, keys))
    return _join(per_block, *hidden.shape[:2]).astype(jnp.int32)


@overload
def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array: ...
@overload
def soft_cap(logits: NamedArray, cap: float | None) -> NamedArray: ...
def soft_cap(logits: jax.Array | NamedArray, cap: float | None) -> jax.Array | NamedArray:
    """``cap * tanh(logits / cap)`` (Gemma 2's logit soft-capping), on plain or named arrays;
    ``logits`` itself if ``cap`` is None."""
    if cap is None:
        return logits
    tanh = hax.tanh if isinstance(logits, hax.NamedArray) else jnp.tanh
    return tanh(logits / cap) * cap


# -- blocks ----------------------------------------------------------------------------------


def _blocks(positions: int, block: int | None) -> int:
    """Positions per block: ``block`` (at most all of them); None: all."""
    return positions if block is None else max(1, min(block, positions))


def _split(x: jax.Array, per_block: int) -> jax.Array:
    """``[rows, positions, ...]`` -> ``[blocks, rows * per_block, ...]``, zero-padded at the end."""
    rows, positions = x.shape[:2]
    count = -(-positions // per_block)
    pad = count * per_block - positions
    if pad:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = jnp.moveaxis(x.reshape(rows, count, per_block, *x.shape[2:]), 1, 0)
    return x.reshape(count, rows * per_block, *x.shape[3:])


def _join(x: jax.Array, rows: int, positions: int) -> jax.Array:
    """The inverse of :func:`_split`."""
    count = x.shape[0]
    x = jnp.moveaxis(x.reshape(count, rows, -1, *x.shape[2:]), 0, 1)
    return x.reshape(rows, -1, *x.shape[3:])[:, :positions]


# -- one block -------------------------------------------------------------------------------


def _logits(h: jax.Array, head: jax.Array, cap: float | None) -> jax.Array:
    return soft_cap(jnp.dot(h, head, preferred_element_type=jnp.float32), cap)


def _block_losses(
    h: jax.Array, head: jax.Array, t: jax.Array, cap: float | None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per-token losses of one block, and what their gradient needs: the softmax's
    unnormalized ``exp(logits - max)``, its row sums, and the logits."""
    logits = _logits(h, head, cap)
    top = jnp.max(logits, axis=-1, keepdims=True)
    exp = jnp.exp(logits - top)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    target = jnp.take_along_axis(logits, t[..., None], axis=-1)
    losses = (top + jnp.log(total) - target)[..., 0]
    return losses, exp, total, logits


def _block_lse(exp_total: jax.Array, logits: jax.Array) -> jax.Array:
    """``logsumexp`` of each row, from :func:`_block_losses`' row sums and logits."""
    return (jnp.max(logits, axis=-1, keepdims=True) + jnp.log(exp_total))[..., 0]


def _block_loss_and_grads(
    h: jax.Array,
    h_t: jax.Array,
    head: jax.Array,
    t: jax.Array,
    w: jax.Array,
    cap: float | None,
    z: float,
    shards: RowShards | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One block's weighted loss sum (with ``z`` times the z-loss), its weighted z-loss sum, its
    gradient with respect to ``h`` and its contribution to the gradient with respect to ``head``.
    ``h_t`` is ``h`` transposed: the head's gradient is then a plain matmul, which XLA's CPU
    backend runs 5% faster than one that contracts the leading axes of both operands. With
    ``shards``, the head's gradient is one per shard of rows (``[shards, embed, vocab]``)."""
    losses, exp, total, logits = _block_losses(h, head, t, cap)
    # d loss / d logits = w * (softmax - one_hot(target)), through the cap's tanh if any
    scale = w[..., None] / total
    z_sum = jnp.zeros((), jnp.float32)
    if z:  # d (z * lse^2) / d logits = 2 z lse softmax
        lse = _block_lse(total, logits)
        z_sum = jnp.sum(jnp.square(lse) * w)
        losses = losses + z * jnp.square(lse)
        scale = scale * (1.0 + 2.0 * z * lse[..., None])
    d_logits = exp * scale - jax.nn.one_hot(t, exp.shape[-1], dtype=exp.dtype) * w[..., None]
    if cap is not None:
        d_logits = d_logits * (1.0 - jnp.square(logits / cap))
    d_logits = d_logits.astype(h.dtype)
    d_h = jnp.dot(d_logits, head.T, preferred_element_type=jnp.float32)
    if shards is not None and shards.count > 1:
        n = shards.count
        per_shard = (h.reshape(n, -1, h.shape[-1]), d_logits.reshape(n, -1, d_logits.shape[-1]))
        d_head = shards.place(jnp.einsum("sre,srv->sev", *per_shard, preferred_element_type=jnp.float32))
    else:
        d_head = jnp.dot(h_t, d_logits, preferred_element_type=jnp.float32)
    return jnp.sum(losses * w), z_sum, d_h, d_head


# -- the fused loss and its gradient ---------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused(
    block: int | None,
    cap: float | None,
    z: float,
    shards: RowShards | None,
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``(loss sum with z x z-loss, z-loss sum)``; only the first value has a gradient."""
    blocks = _blocks(hidden.shape[1], block)
    h, t, w = _split(hidden, blocks), _split(targets, blocks), _split(weights, blocks)

    def sums(xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        losses, _, total, logits = _block_losses(xs[0], head, xs[1], cap)
        z_terms = jnp.square(_block_lse(total, logits)) if z else jnp.zeros_like(losses)
        return jnp.sum((losses + z * z_terms) * xs[2]), jnp.sum(z_terms * xs[2])

    loss, z_sum = jax.lax.map(sums, (h, t, w))
    return jnp.sum(loss), jnp.sum(z_sum)


_Residuals = tuple[jax.Array, jax.Array, jax.Array]  # d hidden, d head, the weights


def _fused_forward(
    block: int | None,
    cap: float | None,
    z: float,
    shards: RowShards | None,
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
) -> tuple[tuple[jax.Array, jax.Array], _Residuals]:
    per_block = _blocks(hidden.shape[1], block)
    h, t, w = _split(hidden, per_block), _split(targets, per_block), _split(weights, per_block)

    def step(
        carry: tuple[jax.Array, jax.Array, jax.Array], xs: tuple[jax.Array, jax.Array, jax.Array, jax.Array]
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
        loss, z_sum, d_head = carry
        block_loss, block_z, d_h, block_d_head = _block_loss_and_grads(*xs[:2], head, *xs[2:], cap, z, shards)
        return (loss + block_loss, z_sum + block_z, d_head + block_d_head), d_h

    split = shards is not None and shards.count > 1
    if shards is not None and split:
        d_head_init = shards.place(jnp.zeros((shards.count, *head.shape), jnp.float32))
    else:
        d_head_init = jnp.zeros(head.shape, jnp.float32)
    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), d_head_init)
    (loss, z_sum, d_head), d_h = jax.lax.scan(step, init, (h, jnp.swapaxes(h, 1, 2), t, w))
    if split:
        d_head = jnp.sum(d_head, axis=0)  # over the shards, once
    d_hidden = _join(d_h, *hidden.shape[:2]).astype(hidden.dtype)
    return (loss, z_sum), (d_hidden, d_head.astype(head.dtype), weights)


def _fused_backward(
    block: int | None,
    cap: float | None,
    z: float,
    shards: RowShards | None,
    residuals: _Residuals,
    g: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array, None, jax.Array]:
    d_hidden, d_head, weights = residuals
    g_loss = g[0]  # the z-loss sum alone is a metric: its cotangent is ignored
    # targets are integers (no gradient); the weights are data, not parameters
    return (
        (g_loss * d_hidden).astype(d_hidden.dtype),
        (g_loss * d_head).astype(d_head.dtype),
        None,
        jnp.zeros_like(weights),
    )


_fused.defvjp(_fused_forward, _fused_backward)
