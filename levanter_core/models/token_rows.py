"""The rows of particular tokens in a model's embeddings and output head: re-drawing them for
tokens a pretrained model never saw (Levanter's ``reinit_tokens``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

import jax
import jax.numpy as jnp
from haliax import NamedArray

from levanter_core.errors import ConfigError

if TYPE_CHECKING:
    import jax
    from haliax import NamedArray

    from levanter_core.data.tokenizer import Tokenizer

_Model = TypeVar("_Model")


def token_ids(tokenizer: Tokenizer, tokens: Iterable[str], *, field: str) -> list[int]:
    """The ids of ``tokens`` in ``tokenizer``. Raises :class:`ConfigError` naming ``field`` for a
    token the vocabulary does not have (written as the vocabulary stores it)."""
    lookup = getattr(tokenizer, "token_id", None)
    ids = []
    for token in tokens:
        found = lookup(token) if lookup else None
        if found is None:
            raise ConfigError(
                f"{field}: {token!r} is not a token of data.tokenizer ({tokenizer.name}); name tokens of its "
                "vocabulary, or add them with special_tokens.additional_special_tokens"
            )
        ids.append(found)
    return ids


def reinitialize_rows(
    model: _Model, ids: list[int], key: jax.Array, *, embeddings: bool = True, lm_head: bool = True
) -> _Model:
    """``model`` with the rows of token ``ids`` drawn afresh in each array along its ``vocab`` axis:
    the input embeddings (with ``embeddings``; tied weights are these) and an untied output head (a
    leaf under ``lm_head``, with ``lm_head``). Each row is drawn from a normal distribution cut at
    3 standard deviations, with the per-feature mean and standard deviation of the whole matrix, as
    Levanter's ``reinit_tokens`` does (a token unseen in pretraining has a far smaller norm than
    the rest; https://github.com/marin-community/marin/issues/954)."""
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, NamedArray))
    index = jnp.asarray(ids, dtype=jnp.int32)
    out = []
    for n, (path, leaf) in enumerate(paths_and_leaves):
        if isinstance(leaf, NamedArray) and "vocab" in {a.name for a in leaf.axes}:
            is_head = "lm_head" in jax.tree_util.keystr(path)
            if lm_head if is_head else embeddings:
                leaf = _redraw(leaf, index, jax.random.fold_in(key, n))
        out.append(leaf)
    redrawn: _Model = jax.tree_util.tree_unflatten(treedef, out)
    return redrawn


def _redraw(array: NamedArray, index: jax.Array, key: jax.Array) -> NamedArray:
    order = ("vocab", *(a.name for a in array.axes if a.name != "vocab"))
    moved = array.rearrange(order)
    values = moved.array
    mean, std = values.mean(axis=0), values.std(axis=0)
    drawn = jax.random.truncated_normal(key, -3.0, 3.0, (index.shape[0], *values.shape[1:]), values.dtype)
    values = values.at[index].set(drawn * std + mean)
    return NamedArray(values, moved.axes).rearrange(array.axes)
