"""Naming the leaves of a checkpointed pytree: each array leaf's name (its path in the state,
which is where its zarr array goes), and what is stored for it (its description in
``metadata.json``; typed PRNG keys as their raw key data)."""

from __future__ import annotations

import re
from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from levanter_core.checkpoint.layout import COMMIT_MARKER, METADATA_FILE

_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.=-]")


def _flatten(tree: Any) -> tuple[list, Any, dict[str, int]]:
    """The leaves of ``tree`` (a NamedArray is one leaf), its structure, and for each leaf
    holding an array, its name -> its index among the leaves."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, hax.NamedArray))
    names: dict[str, int] = {}
    for i, (key_path, leaf) in enumerate(flat):
        if _unwrap(leaf) is None:
            continue
        name = _leaf_name(key_path)
        if name in names or name in (METADATA_FILE, COMMIT_MARKER):
            raise ValueError(
                f"cannot checkpoint this state: two of its leaves, or a leaf and a file, are named {name!r}"
            )
        names[name] = i
    return [leaf for _, leaf in flat], treedef, names


def _leaf_name(key_path: tuple) -> str:
    """``model/transformer/blocks/attn/c_attn/weight``: one path component per pytree key,
    each made safe as a file name."""
    parts = []
    for key in key_path:
        part = _UNSAFE_CHARS.sub("_", jax.tree_util.keystr((key,), simple=True))
        parts.append(part if part and not part.startswith(".") else "_" + part)
    return "/".join(parts) or "value"


def _unwrap(leaf: Any) -> Any:
    """The array (or ShapeDtypeStruct) a leaf holds, or None when it holds none."""
    if isinstance(leaf, hax.NamedArray):
        leaf = leaf.array
    return leaf if isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)) else None


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _describe(name: str, x: Any) -> dict:
    described = {"name": name, "shape": list(x.shape), "dtype": str(x.dtype)}
    if _is_key(x) and not isinstance(x, jax.ShapeDtypeStruct):
        described["key_impl"] = str(jax.random.key_impl(x))
    return described


def _stored_form(x: Any) -> jax.Array:
    """What goes into zarr: typed PRNG keys as their raw key data, NumPy values as jax arrays."""
    if _is_key(x):
        return jax.random.key_data(x)
    return x if isinstance(x, jax.Array) else jnp.asarray(x)
