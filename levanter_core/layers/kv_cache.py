"""What an attention layer remembers between decoding steps.

:class:`KvCache` holds every layer's keys and values for a batch of sequences, indexed by
position: a decoding step projects only its new tokens, writes their keys and values at
their positions, and attends over the positions so far. Rows (one per sequence) are
independent, so an engine can put a new sequence into a row while the others go on.

It sits with the layers because models read and write it in their forward pass; the engine
(:mod:`levanter_core.inference`) only creates and moves rows of it.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from jax.typing import ArrayLike


class KvCache(eqx.Module):
    """Keys and values of every layer, axes ``(layers, batch, *heads, key_position, head)``.

    ``heads`` are whatever head axes the model's attention projects (``kv_heads`` for
    grouped-query attention, ``heads`` for GPT-2 and latent attention); ``head`` is the size
    of one head (keys and values may differ, as in latent attention). A position is written
    once, when its token is decoded; attention at position ``p`` reads positions ``<= p``
    only, so whatever a row held before (padding, an earlier sequence) is never seen."""

    k: NamedArray
    v: NamedArray

    @staticmethod
    def zeros(Layers: Axis, Batch: Axis, KeyPos: Axis, k_like: NamedArray, v_like: NamedArray) -> KvCache:
        """An empty cache whose keys and values have the head axes and dtype of ``k_like`` and
        ``v_like``: an attention layer's projection of some tokens, whose axes other than
        ``layers``, batch and ``position`` are the heads' and, last, the head's own."""
        return KvCache(_empty(Layers, Batch, KeyPos, k_like), _empty(Layers, Batch, KeyPos, v_like))

    @property
    def Batch(self) -> Axis:
        return self.k.axes[1]

    @property
    def KeyPos(self) -> Axis:
        return self.k.resolve_axis("key_position")

    def write(self, layer: ArrayLike, k: NamedArray, v: NamedArray, positions: NamedArray) -> KvCache:
        """The cache with layer ``layer``'s keys ``k`` and values ``v`` of new tokens written at
        ``positions`` (``(batch, position)``; ``k`` and ``v`` have those axes and the heads'). A
        position past the cache's end is dropped."""
        return KvCache(_scatter(self.k, layer, k, positions), _scatter(self.v, layer, v, positions))

    def layer(self, layer: ArrayLike, key_len: int) -> tuple[NamedArray, NamedArray]:
        """Layer ``layer``'s keys and values at positions ``0 .. key_len - 1``, axes
        ``(batch, *heads, key_position, head)``."""
        return _read(self.k, layer, key_len), _read(self.v, layer, key_len)

    def insert(self, rows: ArrayLike, other: KvCache) -> KvCache:
        """The cache with ``other``'s rows (all of them) put at ``rows`` (an integer array)."""
        return KvCache(_put_rows(self.k, rows, other.k), _put_rows(self.v, rows, other.v))


def _empty(Layers: Axis, Batch: Axis, KeyPos: Axis, like: NamedArray) -> NamedArray:
    *heads, head = (ax for ax in like.axes if ax.name not in (Layers.name, Batch.name, "position"))
    return hax.zeros((Layers, Batch, *heads, KeyPos, head), dtype=like.dtype)


def _scatter(cache: NamedArray, layer: ArrayLike, new: NamedArray, positions: NamedArray) -> NamedArray:
    Batch, *heads, _, head = cache.axes[1:]
    new = new.rearrange((Batch.name, "position", *(h.name for h in heads), head.name)).astype(cache.dtype)
    rows = jnp.arange(Batch.size)[:, None]
    where = positions.rearrange((Batch.name, "position")).array
    # layer, rows and positions index together (their broadcast shape, batch x position, comes
    # first); the head axes are sliced: the update is laid out (batch, position, *heads, head)
    index = (jnp.asarray(layer), rows, *(slice(None),) * len(heads), where, slice(None))
    return hax.named(cache.array.at[index].set(new.array, mode="drop"), cache.axes)


def _read(cache: NamedArray, layer: ArrayLike, key_len: int) -> NamedArray:
    one = jax.lax.dynamic_index_in_dim(cache.array, jnp.asarray(layer), axis=0, keepdims=False)
    axes = list(cache.axes[1:])
    axes[-2] = axes[-2].resize(key_len)
    return hax.named(one[..., :key_len, :], tuple(axes))


def _put_rows(cache: NamedArray, rows: ArrayLike, other: NamedArray) -> NamedArray:
    return hax.named(cache.array.at[:, jnp.asarray(rows)].set(other.array.astype(cache.dtype), mode="drop"), cache.axes)
