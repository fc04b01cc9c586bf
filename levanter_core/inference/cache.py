"""What a model without a key/value interface remembers between decoding steps.

:class:`TokenHistory` is the tokens themselves, over which each step runs the whole model
again (slower, but any causal language model decodes this way). The key/value cache of
attention layers is :class:`levanter_core.layers.kv_cache.KvCache` (importing it from here
still works, with a deprecation warning).
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from levanter_core._deprecated import moved

__getattr__ = moved(__name__, {"KvCache": "levanter_core.layers.kv_cache"})


class TokenHistory(eqx.Module):
    """The tokens of each row so far, ``(batch, key_position)``: the cache of a model decoded by
    running it over the whole sequence at every step."""

    tokens: NamedArray

    @staticmethod
    def zeros(Batch: Axis, KeyPos: Axis) -> TokenHistory:
        return TokenHistory(hax.zeros((Batch, KeyPos), dtype=jnp.int32))

    @property
    def Batch(self) -> Axis:
        return self.tokens.axes[0]

    @property
    def KeyPos(self) -> Axis:
        return self.tokens.axes[1]

    def write(self, tokens: NamedArray, positions: NamedArray) -> TokenHistory:
        Batch = self.Batch
        new = tokens.rearrange((Batch.name, "position")).array.astype(jnp.int32)
        where = positions.rearrange((Batch.name, "position")).array
        rows = jnp.arange(Batch.size)[:, None]
        return TokenHistory(hax.named(self.tokens.array.at[rows, where].set(new, mode="drop"), self.tokens.axes))

    def insert(self, rows, other: TokenHistory) -> TokenHistory:
        return TokenHistory(
            hax.named(self.tokens.array.at[jnp.asarray(rows)].set(other.tokens.array, mode="drop"), self.tokens.axes)
        )
