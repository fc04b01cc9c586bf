"""Newton-Schulz orthogonalization, and finding the matrices of a Haliax model: what Muon and
Scion share.

**The iteration.** :func:`newton_schulz` maps a matrix ``G = U S V^T`` to approximately
``U V^T`` (the nearest semi-orthogonal matrix) using only matrix products: scale ``G`` by its
Frobenius norm so that every singular value is at most 1, then apply ``steps`` times the
quintic ``X <- a X + b (X X^T) X + c (X X^T)^2 X``, which acts on each singular value ``s`` as
``s <- a s + b s^3 + c s^5``. The coefficients ``(a, b, c) = (3.4445, -4.7750, 2.0315)`` are
Keller Jordan's (modded-nanogpt), used by Levanter and as optax's default: chosen for a steep
slope at zero, so small singular values grow fast, at the price of not converging to 1 exactly
(the singular values end up scattered around 1, roughly in ``[0.7, 1.2]``), which does not hurt
training.

**Precision.** The iteration runs in the dtype of the array it is given, as Levanter's does:
float32 when the parameters (and so the gradients and the momentum) are float32, as under
the usual ``mp: p=f32,c=bfloat16``. Keller Jordan's reference casts to bfloat16 for speed;
this does not, so the result does not depend on the compute precision.

**The matrices.** A Haliax linear layer's weight has named input axes (``In``) and output axes
(``Out``), each possibly several (attention's ``(heads, head_size)``), and may carry more
axes: a ``layers`` axis when the blocks are stacked for a scan (``hnn.Stacked``), an
``experts`` axis in a mixture-of-experts layer. :func:`map_matrices` flattens ``Out`` and ``In``
into the last two axes of the raw array, ``(..., d_out, d_in)``, keeping every other axis in
front as a batch axis, so that each layer and each expert is its own matrix; and puts the
result back in the weight's own axes. :func:`newton_schulz` works on such batches directly
(batched matrix products, the same as a ``vmap`` over the leading axes).

Which modules hold matrices, and their axes (:func:`matrix_fields`): ``haliax.nn.Linear``
(``weight``, its ``In`` and ``Out``), ``haliax.nn.MoELinear`` (likewise, ``Experts`` being a batch
axis), and the core's mixture-of-experts layers (``levanter_core.layers.moe``): the router
(``weight``, ``embed -> experts``) and the routed experts (``gate_proj`` and ``up_proj``,
``embed -> mlp``; ``down_proj``, ``mlp -> embed``), which keep their matrices as plain named
arrays.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp

from levanter_core.layers.moe import Experts, Router
from levanter_core.optim import parameter_path

PyTree = Any

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients ``(a, b, c)``, as in Levanter and optax."""

LEVANTER_EXCLUDED = ("Embedding", "lm_head")
"""Levanter leaves a linear layer to the element-wise optimizer when its path contains one of
these: the output projection (``lm_head``), whose rows are per-token like an embedding's."""


def newton_schulz(x: jax.Array, steps: int, eps: float = 1e-8) -> jax.Array:
    """Approximately orthogonalize each matrix in the last two axes of ``x`` (shape
    ``(..., m, n)``; any leading axes are a batch): ``steps`` quintic Newton-Schulz iterations
    (:data:`NS_COEFFICIENTS`) after dividing each matrix by its Frobenius norm plus ``eps``.
    Returns an array of ``x``'s shape and dtype."""
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs matrices (at least 2 axes), got shape {x.shape}")
    a, b, c = NS_COEFFICIENTS
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
    x = x / (norm + eps)
    # The iteration commutes with transposition; work on the wide side so that the Gram
    # matrix X X^T is the smaller of the two.
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -2, -1)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -2, -1)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if tall:
        x = jnp.swapaxes(x, -2, -1)
    return x


@dataclasses.dataclass(frozen=True)
class MatrixAxes:
    """The input and output axes (names) of one weight matrix; any other axis of the weight
    is a batch axis (``layers``, ``experts``)."""

    In: tuple[str, ...]
    Out: tuple[str, ...]


def _names(spec) -> tuple[str, ...]:
    return tuple(hax.axis_name(ax) for ax in hax.axis_spec_to_tuple(spec))


def matrix_fields(node) -> dict[str, MatrixAxes] | None:
    """The fields of ``node`` that are weight matrices and their axes, or None if ``node``
    holds none (see the module's docstring for the modules recognized)."""
    if isinstance(node, (hnn.Linear, hnn.MoELinear)):
        return {"weight": MatrixAxes(_names(node.In), _names(node.Out))}
    if isinstance(node, Experts):
        embed, mlp = node.config.Embed.name, node.config.Mlp.name
        up = MatrixAxes((embed,), (mlp,))
        return {"gate_proj": up, "up_proj": up, "down_proj": MatrixAxes((mlp,), (embed,))}
    if isinstance(node, Router):
        return {"weight": MatrixAxes(("embed",), ("experts",))}
    return None


def _is_holder_or_array(x) -> bool:
    return matrix_fields(x) is not None or hax.is_named_array(x)


def _is_present(x) -> bool:
    # not None, and not masked out by optax.partition (a MaskedNode in place of the array)
    return hax.is_named_array(x) and hasattr(x.array, "shape")


def matrix_paths(tree: PyTree, exclude: tuple[str, ...] = LEVANTER_EXCLUDED) -> dict[tuple, MatrixAxes]:
    """The key paths (as ``jax.tree_util.tree_flatten_with_path`` gives them, NamedArrays being
    leaves) of the weight matrices in ``tree`` and their axes, leaving out those whose dotted
    path contains one of ``exclude`` (Levanter's rule: the LM head)."""
    found = {}
    nodes, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_holder_or_array)
    for path, node in nodes:
        for field, axes in (matrix_fields(node) or {}).items():
            if not _is_present(getattr(node, field)):
                continue
            full = path + (jax.tree_util.GetAttrKey(field),)
            if not any(word in parameter_path(full) for word in exclude):
                found[full] = axes
    return found


def label_matrices(tree: PyTree, matrix: str, other: str, exclude: tuple[str, ...] = LEVANTER_EXCLUDED) -> PyTree:
    """``tree`` with the label ``matrix`` in place of each weight matrix (a whole NamedArray)
    and ``other`` in place of every other array: the ``param_labels`` of ``optax.partition``
    for an optimizer that treats matrices apart."""
    matrices = matrix_paths(tree, exclude)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: matrix if path in matrices else other, tree, is_leaf=hax.is_named_array
    )


def map_matrices(fn: Callable[[jax.Array], jax.Array], tree: PyTree) -> PyTree:
    """``tree`` with ``fn`` applied to every weight matrix (of a module :func:`matrix_fields`
    recognizes) that is a NamedArray. ``fn`` gets the raw array with the output axes flattened
    into the second-to-last axis and the input axes into the last, ``(..., d_out, d_in)``, any
    other axes (layers, experts) leading; it returns an array of that shape, which is put back
    in the weight's own axes. Anything else in ``tree`` (MaskedNodes included) is unchanged."""

    def as_matrix(weight: hax.NamedArray, axes: MatrixAxes) -> hax.NamedArray:
        names = set(axes.In) | set(axes.Out)
        batch = tuple(ax for ax in weight.axes if ax.name not in names)
        ordered = weight.rearrange((*batch, *axes.Out, *axes.In))
        d_out = math.prod(weight.resolve_axis(n).size for n in axes.Out)
        d_in = math.prod(weight.resolve_axis(n).size for n in axes.In)
        flat = ordered.array.reshape(*(ax.size for ax in batch), d_out, d_in)
        out = fn(flat)
        return hax.named(out.reshape(ordered.array.shape), ordered.axes).rearrange(weight.axes)

    def visit(node):
        fields = matrix_fields(node)
        if fields is None:
            return node
        present = [f for f in fields if _is_present(getattr(node, f))]
        if not present:
            return node
        new = [as_matrix(getattr(node, f), fields[f]) for f in present]
        return eqx.tree_at(lambda n: [getattr(n, f) for f in present], node, new)

    return jax.tree.map(visit, tree, is_leaf=lambda x: matrix_fields(x) is not None)


def shape_scale(d_out: int, d_in: int, kimi: bool = False) -> float:
    """The factor an orthogonalized update of a ``d_out x d_in`` matrix is multiplied by:
    ``sqrt(max(1, d_out / d_in))`` (Keller Jordan's, and Levanter's default), or with ``kimi``
    ``0.2 * sqrt(max(d_out, d_in))`` (Moonshot's "Muon is Scalable", which gives the update the
    RMS of a typical AdamW update, so AdamW's learning rate and weight decay carry over)."""
    if kimi:
        return 0.2 * math.sqrt(max(d_out, d_in))
    return math.sqrt(max(1.0, d_out / d_in))


def orthogonalized(steps: int, eps: float, kimi: bool = False) -> Callable[[jax.Array], jax.Array]:
    """For :func:`map_matrices`: the Newton-Schulz orthogonalization of each ``(d_out, d_in)``
    matrix, times :func:`shape_scale`."""

    def fn(x: jax.Array) -> jax.Array:
        scale = shape_scale(x.shape[-2], x.shape[-1], kimi)
        return newton_schulz(x, steps, eps) * scale

    return fn
