"""``trainer.watch``: norms and histograms of the parameters, gradients and updates.

Every ``interval`` steps the training step also computes, on the device, the
global norm of each watched tree, the norm of each parameter (per layer for
layers stacked with ``hnn.Stacked``, when ``split_scan_layers``), and
optionally a histogram of each. On other steps the work is skipped (a
``lax.cond``), and nothing is logged. The statistics come back with the step's
metrics, one step late like them, so watching adds no host synchronization.

Logged names: ``watch/{target}/norm``, ``watch/{target}/norm/{parameter}`` and
``watch/{target}/hist/{parameter}`` (a :class:`~levanter_core.tracker.Histogram`),
with ``target`` one of ``params``, ``grads``, ``updates`` and ``parameter`` the
path of the array in the model (``transformer/blocks/attn/c_attn/weight``),
followed by ``/layer_{i}`` for a layer of a stack.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray
from pydantic import Field, PositiveInt

from levanter_core.config.base import ConfigModel
from levanter_core.tracker import Histogram

WatchTarget = Literal["params", "grads", "updates"]
HISTOGRAM_BINS = 64
_PREFIX = "watch/"


class WatchConfig(ConfigModel):
    """What to watch, and how often."""

    watch_targets: tuple[WatchTarget, ...] = ("grads", "params")
    """Trees to watch: ``params`` (the weights after the step), ``grads``, ``updates``
    (what the optimizer added to the weights)."""
    include_norms: bool = True
    """Log the global norm of each watched tree."""
    include_per_parameter_norms: bool = True
    """Log the norm of every parameter (and of every layer of a stack)."""
    include_histograms: bool = False
    """Log a histogram of every parameter's values (64 bins between its min and max)."""
    split_scan_layers: bool = True
    """Split parameters stacked over a ``layers`` axis into one entry per layer."""
    interval: PositiveInt = Field(10)
    """Compute and log every this many steps."""


def _entries(tree, split_layers: bool):
    """``(name, array)`` for every floating-point array of ``tree``, split per layer."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, NamedArray))[0]
    for path, leaf in leaves:
        array = leaf.array if isinstance(leaf, NamedArray) else leaf
        if not (hasattr(array, "dtype") and jnp.issubdtype(array.dtype, jnp.floating)):
            continue
        name = "/".join(_part(p) for p in path)
        axes = [ax.name for ax in leaf.axes] if isinstance(leaf, NamedArray) else []
        if split_layers and axes and axes[0] in ("layers", "layer"):
            for i in range(array.shape[0]):
                yield f"{name}/layer_{i}", array[i]
        else:
            yield name, array


def _part(key) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _histogram(array) -> dict:
    x = array.astype(jnp.float32).ravel()
    finite = jnp.isfinite(x)
    lo = jnp.min(jnp.where(finite, x, jnp.inf))
    hi = jnp.max(jnp.where(finite, x, -jnp.inf))
    hi = jnp.where(hi > lo, hi, lo + 1.0)
    counts, edges = jnp.histogram(jnp.where(finite, x, lo), bins=HISTOGRAM_BINS, range=(lo, hi))
    counts = counts - jnp.zeros_like(counts).at[0].set(jnp.sum(~finite))  # non-finite entries are not binned
    return {
        "counts": counts,
        "edges": edges,
        "min": lo,
        "max": hi,
        "num": jnp.asarray(x.size, jnp.int32),
        "sum": jnp.sum(jnp.where(finite, x, 0.0)),
        "sum_squares": jnp.sum(jnp.where(finite, x * x, 0.0)),
    }


def watch_stats(config: WatchConfig, step, trees: dict) -> dict:
    """The watched statistics of ``trees`` (target -> pytree) as ``watch/...`` metrics,
    computed when ``step`` (a traced scalar) is a multiple of ``config.interval``, zeros
    otherwise (the host does not log them then)."""

    def compute(_):
        out: dict[str, Any] = {}
        for target in config.watch_targets:
            entries = list(_entries(trees[target], config.split_scan_layers))
            norms = {name: jnp.sqrt(jnp.sum(jnp.square(a.astype(jnp.float32)))) for name, a in entries}
            if config.include_norms:
                out[f"{_PREFIX}{target}/norm"] = jnp.sqrt(sum(jnp.square(n) for n in norms.values()))
            if config.include_per_parameter_norms:
                out.update({f"{_PREFIX}{target}/norm/{name}": n for name, n in norms.items()})
            if config.include_histograms:
                out.update({f"{_PREFIX}{target}/hist/{name}": _histogram(a) for name, a in entries})
        return out

    shapes = jax.eval_shape(compute, None)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.cond(step % config.interval == 0, compute, lambda _: zeros, None)


def is_watch_metric(name: str) -> bool:
    return name.startswith(_PREFIX)


def host_value(value):
    """A fetched watch value as a tracker receives it: a number, or a Histogram."""
    if isinstance(value, dict):
        return Histogram(
            np.asarray(value["counts"]),
            np.asarray(value["edges"]),
            float(value["min"]),
            float(value["max"]),
            int(value["num"]),
            float(value["sum"]),
            float(value["sum_squares"]),
        )
    return float(value)
