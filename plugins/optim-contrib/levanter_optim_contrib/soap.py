"""SOAP (Vyas et al. 2024, https://arxiv.org/abs/2409.11321): ``type: soap``.

SOAP runs Adam in the eigenbasis of Shampoo's preconditioner. For each dimension ``i`` of a
parameter tensor that it preconditions, it keeps Shampoo's statistic ``L_i`` (a ``d_i x d_i``
moving average of the gradient contracted with itself over every other dimension) and an
orthogonal basis ``Q_i`` of its eigenvectors; ``x'`` below is ``x`` with each such dimension
rotated into its basis (``x'`` contracts dimension ``i`` with ``Q_i``)::

    m_t  = beta1 m_{t-1} + (1 - beta1) g_t                 (in the parameters' own basis)
    v_t  = beta2 v_{t-1} + (1 - beta2) (g_t')^2            (in the rotated basis)
    u_t  = rotate_back(m_t' / (sqrt(v_t) + epsilon)) * sqrt(1 - beta2^t) / (1 - beta1^t)
    L_i  = shampoo_beta L_i + (1 - shampoo_beta) contract(g_t, g_t; all dimensions but i)
    W_t  = W_{t-1} - lr_t (u_t + weight_decay W_{t-1})

The first step only starts the statistics from its gradient and takes each ``Q_i`` from an
eigendecomposition (``eigh``), moving the parameters by weight decay alone (as Levanter's
does); Adam's steps, counted by ``t``, start with the second. After
every ``precondition_frequency``-th Adam step the bases are refreshed by one step of power
iteration: the columns of ``Q_i`` are sorted by their estimated eigenvalues
``diag(Q_i^T L_i Q_i)`` (``v`` is permuted with them), then ``Q_i = qr(L_i Q_i)``. Both the
eigendecomposition and the refresh run inside ``jax.lax.cond`` on the step count, so the other
steps do not pay for them.

Which tensors, as in Levanter: every parameter array is one tensor (embeddings, norms and
biases too), except that the leading ``layers`` axis of the arrays inside a haliax ``Stacked``
is not a dimension of the tensor: each layer is preconditioned on its own (``vmap``), so a
stacked model takes the same steps as the same model unrolled. Other axes (heads, experts) are
dimensions of the tensor. With ``merge_small_dims`` consecutive dimensions are first merged
into dimensions of about ``target_merged_dim_size`` (Levanter's cost heuristic, so the same
shapes result). A dimension gets a preconditioner when its length is between 2 and
``max_precond_dim``; along the others Adam stays diagonal (``one_diag``: only the first such
dimension gets one). With ``partition_grads_into_blocks``, each preconditioned dimension longer
than ``block_size`` is cut into blocks of ``block_size`` (the last one shorter), and each block
of the tensor has statistics and bases of its own.

The state is arrays only: ``mu`` and ``nu`` (``m`` and ``v``) have the parameters' structure
and axes, so they are stored split like the parameters; the statistics and bases are plain
arrays with a leading axis for the layers and blocks they stack, stored whole on each device.

Differences from Levanter's SOAP (each follows the paper's reference implementation):

* Bias correction counts Adam's steps; Levanter counts the first, preconditioner-only step too.
* The refresh follows the ``t``-th Adam step when ``t`` is a multiple of
  ``precondition_frequency`` and uses the statistics including that step's gradient;
  Levanter's follows the steps one earlier and uses the statistics before the gradient.
* A dimension of exactly ``max_precond_dim`` is preconditioned (Levanter: only shorter ones),
  and so is a one-dimensional array only when it is no longer than ``max_precond_dim``
  (Levanter: at any length).
* A block shorter than ``block_size`` (the last one of a dimension, or a whole dimension
  shorter than it) is preconditioned at its own length; Levanter pads it with zeros to
  ``block_size``.

The matrix products run at the highest precision, as Levanter's do (it has no field for it);
``eigh`` and ``qr`` run in float32 at least whatever ``precond_dtype`` stores.

Small models: ``merge_small_dims`` merges a whole small weight into one long vector (a 32x96
matrix into 3072 entries, cut into blocks of 256), and a vector's statistic gains rank one per
step. Until it has full rank its eigenvectors for the eigenvalue 0 are an arbitrary basis of
its null space, drawn anew at each refresh, which leaves Adam's second moment along them
stale: on the tiny GPT-2 of the tests, refreshing every step or every 4 steps trains more
slowly than the default 10. Weights of real models (dimensions near ``target_merged_dim_size``)
stay matrices, whose blocks' statistics have full rank after a step or two.

CPU: ``eigh`` and ``qr`` call scipy's OpenBLAS from XLA's own threads; with OpenBLAS threads of
its own on top they run several times slower (30 times on a busy 2-core machine), so set
``OPENBLAS_NUM_THREADS=1`` there. They also take one matrix per call on CPU, see
:func:`_one_matrix_at_a_time_on_cpu`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import haliax.nn as hnn
import jax
import jax.numpy as jnp
import optax
from pydantic import Field

from levanter_core.config.base import accepted_only_as
from levanter_core.optim import OptimizerConfig
from levanter_optim_contrib.fields import FloatDtype

PyTree = Any
_HIGHEST = jax.lax.Precision.HIGHEST


# -- how each parameter array is cut into the tensors SOAP preconditions -------------------


def _merge_cost(size: int, target: int) -> float:
    """How far a merged dimension of ``size`` is from the ``target`` length (Levanter's
    heuristic): mildly penalized below it, steeply below an eighth of it, more above it, and
    prohibitively above eight times it."""
    if size < target:
        cost = math.log2(target / size)
        if size < target / 8:
            cost += 100 * math.log2(target / 8 / size)
        return cost
    cost = 10 * math.log2(size / target)
    if size > 8 * target:
        cost += 1000 * math.log2(size / (8 * target))
    return cost


def _runs(n: int):
    """Every way to cut ``n`` consecutive dimensions into runs, as tuples of run lengths,
    shortest first run first (the order in which Levanter breaks ties)."""
    if n == 0:
        yield ()
        return
    for first in range(1, n + 1):
        for rest in _runs(n - first):
            yield (first, *rest)


def merged_shape(shape: tuple[int, ...], target: int) -> tuple[int, ...]:
    """``shape`` with runs of consecutive dimensions merged (multiplied) so that the total
    :func:`_merge_cost` is least; among equal costs the first found in :func:`_runs`' order."""
    if not shape or 0 in shape:
        return tuple(shape)

    def merge(runs):
        ends = list(itertools.accumulate(runs))
        return tuple(math.prod(shape[end - run : end]) for run, end in zip(runs, ends))

    return min((merge(runs) for runs in _runs(len(shape))), key=lambda dims: sum(_merge_cost(d, target) for d in dims))


@dataclass(frozen=True)
class _Blocks:
    """Equally shaped blocks of a tensor: along each dimension, where the first starts, how
    many follow one another and their length."""

    start: tuple[int, ...]
    count: tuple[int, ...]
    size: tuple[int, ...]


@dataclass(frozen=True)
class TensorLayout:
    """How one parameter array is seen by SOAP: ``lead`` leading (stacked-layer) axes, each
    index of which is its own tensor; the tensor's dimensions ``merged`` after merging; which of
    them are ``preconditioned``; and ``blocks``, the groups of equally shaped blocks the tensor
    is cut into (one group covering it whole when nothing is cut)."""

    lead: tuple[int, ...]
    shape: tuple[int, ...]
    merged: tuple[int, ...]
    preconditioned: tuple[bool, ...]
    blocks: tuple[_Blocks, ...]

    def _where(self, blocks: _Blocks) -> tuple[slice, ...]:
        spans = (slice(s, s + c * z) for s, c, z in zip(blocks.start, blocks.count, blocks.size))
        return (slice(None),) * len(self.lead) + tuple(spans)

    def split(self, x: jax.Array) -> list[jax.Array]:
        """``x`` (of the parameter's shape) as one array per group of blocks, each of shape
        ``(n, *block_size)``: the layers and blocks of the group stacked on the first axis."""
        n_lead, k = len(self.lead), len(self.merged)
        x = x.reshape(self.lead + self.merged)
        pieces = []
        for blocks in self.blocks:
            piece = x[self._where(blocks)]
            piece = piece.reshape(self.lead + tuple(itertools.chain(*zip(blocks.count, blocks.size))))
            counts_first = (
                *range(n_lead),
                *(n_lead + 2 * i for i in range(k)),
                *(n_lead + 2 * i + 1 for i in range(k)),
            )
            n = math.prod(self.lead) * math.prod(blocks.count)
            pieces.append(piece.transpose(counts_first).reshape((n, *blocks.size)))
        return pieces

    def join(self, pieces: list[jax.Array]) -> jax.Array:
        """The inverse of :meth:`split`."""
        n_lead, k = len(self.lead), len(self.merged)
        whole = None
        for blocks, piece in zip(self.blocks, pieces):
            piece = piece.reshape(self.lead + blocks.count + blocks.size)
            interleaved = (*range(n_lead), *itertools.chain(*((n_lead + i, n_lead + k + i) for i in range(k))))
            spans = tuple(c * z for c, z in zip(blocks.count, blocks.size))
            piece = piece.transpose(interleaved).reshape(self.lead + spans)
            if len(self.blocks) == 1:
                whole = piece
            else:
                if whole is None:
                    whole = jnp.zeros(self.lead + self.merged, piece.dtype)
                whole = whole.at[self._where(blocks)].set(piece)
        return whole.reshape(self.lead + self.shape)


def tensor_layout(
    shape: tuple[int, ...],
    n_lead: int,
    *,
    max_precond_dim: int,
    merge_small_dims: bool,
    target_merged_dim_size: int,
    one_diag: bool,
    block_size: int | None,
) -> TensorLayout:
    """The :class:`TensorLayout` of an array of ``shape`` whose first ``n_lead`` axes are
    stacked layers (see :func:`scale_by_soap` for the other arguments)."""
    lead, tensor = tuple(shape[:n_lead]), tuple(shape[n_lead:])
    merged = merged_shape(tensor, target_merged_dim_size) if merge_small_dims else tensor
    # a dimension of length 1 has nothing to rotate
    preconditioned = [1 < d <= max_precond_dim for d in merged]
    if one_diag and any(preconditioned):
        first = preconditioned.index(True)
        preconditioned = [i == first for i in range(len(merged))]
    per_dim = []
    for d, p in zip(merged, preconditioned):
        if p and block_size is not None and d > block_size:
            full, rest = divmod(d, block_size)
            per_dim.append([(0, full, block_size)] + ([(full * block_size, 1, rest)] if rest else []))
        else:
            per_dim.append([(0, 1, d)])
    blocks = tuple(
        _Blocks(tuple(s for s, _, _ in combo), tuple(c for _, c, _ in combo), tuple(z for _, _, z in combo))
        for combo in itertools.product(*per_dim)
    )
    return TensorLayout(lead, tensor, merged, tuple(preconditioned), blocks)


def stacked_depths(tree: PyTree) -> list[int]:
    """For each array of ``tree`` (in ``jax.tree.leaves`` order), how many of its leading axes
    are the layer axes of the haliax ``Stacked`` modules around it."""
    depths: list[int] = []

    def visit(node, depth):
        inner = lambda x: x is not node and isinstance(x, hnn.Stacked)
        for child in jax.tree.leaves(node, is_leaf=inner):
            if inner(child):
                visit(child, depth + 1)
            else:
                depths.append(depth)

    visit(tree, 1 if isinstance(tree, hnn.Stacked) else 0)
    return depths


# -- SOAP on one tensor (vmapped over the stacked layers and blocks) -----------------------


def _rotate(x: jax.Array, bases, back: bool = False) -> jax.Array:
    """``x`` with each dimension that has a basis expressed in it (``back``: from it)."""
    for i, q in enumerate(bases):
        if q is not None:
            x = jnp.moveaxis(jnp.tensordot(x, q, axes=((i,), (1 if back else 0,)), precision=_HIGHEST), -1, i)
    return x


def _accumulate(stat: jax.Array, g: jax.Array, dim: int, beta: float) -> jax.Array:
    """Shampoo's statistic of dimension ``dim``, moved towards ``g`` contracted with itself
    over every other dimension."""
    others = [a for a in range(g.ndim) if a != dim]
    return beta * stat + (1 - beta) * jnp.tensordot(g, g, axes=(others, others), precision=_HIGHEST)


def _one_matrix_at_a_time_on_cpu(decompose):
    """``decompose`` (of one matrix or a batch) on a batch of matrices, one matrix per call on
    CPU. jaxlib's CPU LAPACK kernels (JAX 0.10) spread a batch over XLA's thread pool and block
    their own pool thread until it is done, so as many batched calls at once as the pool has
    threads (independent arrays, or the devices of a simulated mesh) deadlock it; a call with
    one matrix runs where it is. Other platforms take the batch whole."""

    def batched(x):
        return jax.lax.platform_dependent(x, cpu=lambda x: jax.lax.map(decompose, x), default=decompose)

    return batched


@_one_matrix_at_a_time_on_cpu
def _eigenbases(stats: jax.Array) -> jax.Array:
    """The eigenvectors of the statistics, by decreasing eigenvalue."""
    return jnp.linalg.eigh(stats)[1][..., ::-1]


@_one_matrix_at_a_time_on_cpu
def _orthonormal_bases(products: jax.Array) -> jax.Array:
    """The ``Q`` of the QR decomposition of the products."""
    return jnp.linalg.qr(products)[0]


def _sorted_power_products(stats, bases, nu: jax.Array):
    """For each dimension with a basis ``Q`` and statistic ``L``: ``L Q`` (a step of power
    iteration, to orthonormalize) with the columns sorted by decreasing estimated eigenvalue
    ``diag(Q^T L Q)``, and ``nu`` permuted the same way along that dimension."""
    products = []
    for i, (stat, q) in enumerate(zip(stats, bases)):
        if q is None:
            products.append(None)
            continue
        product = jnp.matmul(stat, q, precision=_HIGHEST)
        order = jnp.argsort(-jnp.sum(q * product, axis=0), stable=True)  # diag(Q^T L Q)
        nu = jnp.take(nu, order, axis=i)
        products.append(product[:, order])
    return products, nu


def _adam_in_eigenbasis(g, m, nu, bases, *, b2: float, epsilon: float):
    """Adam's direction (before bias correction) for the moment ``m``, in ``bases``; ``nu``
    updated with ``g``."""
    nu = b2 * nu + (1 - b2) * jnp.square(_rotate(g, bases))
    return _rotate(_rotate(m, bases) / (jnp.sqrt(nu) + epsilon), bases, back=True), nu


# -- the transformation --------------------------------------------------------------------


class ScaleBySoapState(NamedTuple):
    count: jax.Array  # int32 scalar: updates made, the first (preconditioner-only) one included
    mu: PyTree  # first moment, in the parameters' basis
    nu: PyTree  # second moment, in the rotated basis, stored at the positions of the blocks
    stats: list  # per array, per group of blocks, per dimension: (n, d, d) statistics or None
    bases: list  # the same for the eigenbases


def scale_by_soap(
    *,
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float = 0.95,
    epsilon: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_small_dims: bool = True,
    target_merged_dim_size: int = 2048,
    one_diag: bool = False,
    block_size: int | None = 256,
    mu_dtype: Any = None,
    precond_dtype: Any = None,
) -> optax.GradientTransformation:
    """SOAP's direction (the learning rate and weight decay are applied after it); see the
    module's docstring. ``block_size`` None: no blocks. ``mu_dtype``: of ``mu`` and ``nu``
    (None: the parameters'); ``precond_dtype``: of the statistics and bases (None: float32, or
    the parameters' dtype if wider)."""
    options = dict(
        max_precond_dim=max_precond_dim,
        merge_small_dims=merge_small_dims,
        target_merged_dim_size=target_merged_dim_size,
        one_diag=one_diag,
        block_size=block_size,
    )

    def layouts(tree) -> list[TensorLayout]:
        return [
            tensor_layout(x.shape, depth, **options) for x, depth in zip(jax.tree.leaves(tree), stacked_depths(tree))
        ]

    def init(params):
        leaves = jax.tree.leaves(params)
        stats = []
        for layout, x in zip(layouts(params), leaves):
            dtype = precond_dtype or jnp.promote_types(x.dtype, jnp.float32)
            stats.append(
                [
                    [
                        jnp.zeros((math.prod(layout.lead) * math.prod(b.count), d, d), dtype) if p else None
                        for d, p in zip(b.size, layout.preconditioned)
                    ]
                    for b in layout.blocks
                ]
            )
        # separate arrays everywhere, so that a trainer may donate the state's buffers
        mu, nu = (optax.tree.zeros_like(params, dtype=mu_dtype) for _ in range(2))
        bases = jax.tree.map(jnp.zeros_like, stats)
        return ScaleBySoapState(jnp.zeros((), jnp.int32), mu, nu, stats, bases)

    def update(grads, state, params=None):
        del params
        grad_leaves, structure = jax.tree.flatten(grads)
        plans = layouts(grads)
        computes = [jnp.promote_types(g.dtype, jnp.float32) for g in grad_leaves]
        mu_leaves, nu_leaves = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)

        def blocks_of(leaves):
            return [plan.split(x.astype(c)) for plan, x, c in zip(plans, leaves, computes)]

        def cast_like(new, old):
            return jax.tree.map(lambda n, o: n.astype(o.dtype), new, old)

        accumulate = partial(_accumulate, beta=shampoo_beta)

        def accumulated(g_blocks):
            stats = []
            for leaf_stats, leaf_blocks, c in zip(state.stats, g_blocks, computes):
                stats.append(
                    [
                        [
                            None if s is None else jax.vmap(partial(accumulate, dim=i))(s.astype(c), g)
                            for i, s in enumerate(group_stats)
                        ]
                        for group_stats, g in zip(leaf_stats, leaf_blocks)
                    ]
                )
            return stats

        def first_step():
            stats = accumulated(blocks_of(grad_leaves))
            # epsilon on the diagonal, as in Levanter (it leaves the eigenvectors as they are)
            bases = jax.tree.map(lambda s: _eigenbases(s + epsilon * jnp.eye(s.shape[-1], dtype=s.dtype)), stats)
            zeros = [jnp.zeros_like(g) for g in grad_leaves]
            return zeros, mu_leaves, nu_leaves, cast_like(stats, state.stats), cast_like(bases, state.bases)

        def adam_step():
            t = state.count.astype(jnp.float32)
            mu = [b1 * m.astype(c) + (1 - b1) * g.astype(c) for m, g, c in zip(mu_leaves, grad_leaves, computes)]
            g_blocks, m_blocks, v_blocks = blocks_of(grad_leaves), blocks_of(mu), blocks_of(nu_leaves)
            bases = [
                [[None if q is None else q.astype(c) for q in group] for group in leaf]
                for leaf, c in zip(state.bases, computes)
            ]
            directions, nus = [], []
            for leaf in zip(g_blocks, m_blocks, v_blocks, bases):
                step = jax.vmap(partial(_adam_in_eigenbasis, b2=b2, epsilon=epsilon))
                out = [step(g, m, v, q) for g, m, v, q in zip(*leaf)]
                directions.append([d for d, _ in out])
                nus.append([v for _, v in out])
            stats = accumulated(g_blocks)

            def refresh():
                products, new_nus = [], []
                for leaf_stats, leaf_bases, leaf_nus in zip(stats, bases, nus):
                    parts = zip(leaf_stats, leaf_bases, leaf_nus)
                    out = [jax.vmap(_sorted_power_products)(s, q, v) for s, q, v in parts]
                    products.append([p for p, _ in out])
                    new_nus.append([v for _, v in out])
                return jax.tree.map(_orthonormal_bases, products), new_nus

            new_bases, nus = jax.lax.cond(state.count % precondition_frequency == 0, refresh, lambda: (bases, nus))
            correction = jnp.sqrt(1 - b2**t) / (1 - b1**t)
            updates = [
                (plan.join(d) * correction).astype(g.dtype) for plan, d, g in zip(plans, directions, grad_leaves)
            ]
            nu = [plan.join(v) for plan, v in zip(plans, nus)]
            return (
                updates,
                cast_like(mu, mu_leaves),
                cast_like(nu, nu_leaves),
                cast_like(stats, state.stats),
                cast_like(new_bases, state.bases),
            )

        # The first step only sets up the statistics and their eigenbases, as in the paper.
        updates, mu, nu, stats, bases = jax.lax.cond(state.count == 0, first_step, adam_step)
        unflatten = partial(jax.tree.unflatten, structure)
        new_state = ScaleBySoapState(
            optax.safe_int32_increment(state.count),
            unflatten(mu),
            unflatten(nu),
            stats,
            bases,
        )
        return unflatten(updates), new_state

    return optax.GradientTransformation(init, update)


# -- the config ----------------------------------------------------------------------------


class SoapConfig(OptimizerConfig):
    """SOAP: Adam in the eigenbasis of Shampoo's preconditioner, with gradient clipping,
    decoupled weight decay and the shared learning-rate schedule. See
    :mod:`levanter_optim_contrib.soap` for the algorithm, which tensors it preconditions, and
    where it differs from Levanter's."""

    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay (as in AdamW), scaled by the learning rate. 0 (SOAP's default in
    Levanter) turns it off."""
    beta1: float = Field(0.95, ge=0, lt=1)
    """Decay rate of the running mean of gradients (Adam's first moment)."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """Decay rate of the running mean of squared rotated gradients (Adam's second moment, in
    the eigenbasis)."""
    shampoo_beta: float = Field(0.95, lt=1)
    """Decay rate of Shampoo's statistics (``L`` and ``R`` in the paper), whose eigenvectors
    are the basis Adam runs in. A negative value uses ``beta2`` (as in Levanter)."""
    epsilon: float = Field(1e-8, ge=0)
    """Added to the root of the second moment before dividing, for numerical stability (and to
    the statistics' diagonal before the first eigendecomposition)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip gradients so their global L2 norm is at most this. None turns clipping off."""
    schedule_list: list[str] | None = None
    """Unused in Levanter, where it has no effect; only null is accepted."""
    precondition_frequency: int = Field(10, ge=1)
    """Refresh the eigenbases (one step of power iteration and a QR decomposition) after every
    this many steps."""
    max_precond_dim: int = Field(10000, ge=0)
    """Dimensions longer than this (after merging) get no preconditioner: Adam stays diagonal
    along them. The default leaves out common vocabulary sizes and keeps hidden sizes."""
    merge_small_dims: bool = True
    """Merge consecutive dimensions of each parameter (not the stacked ``layers`` axis) into
    dimensions of about ``target_merged_dim_size`` before preconditioning."""
    one_diag: bool = False
    """Precondition only the first dimension of each tensor that could be (one-sided SOAP),
    saving memory and compute; Adam stays diagonal along the others."""
    target_merged_dim_size: int = Field(2048, ge=1)
    """The length ``merge_small_dims`` aims at for merged dimensions."""
    mu_dtype: FloatDtype = None
    """Data type of Adam's two moments (e.g. ``bfloat16`` to save memory). None: the
    parameters'."""
    precond_dtype: FloatDtype = None
    """Data type in which the statistics and eigenbases are stored. None: float32. The
    eigendecompositions and QR decompositions run in float32 at least either way."""
    partition_grads_into_blocks: bool = True
    """Cut each preconditioned dimension longer than ``block_size`` into blocks of
    ``block_size``, every block of a tensor with its own statistics and eigenbases
    (block-diagonal Shampoo): bounds the cost of the decompositions."""
    block_size: int = Field(256, ge=1)
    """Length of the blocks of ``partition_grads_into_blocks``."""

    _no_schedule_list = accepted_only_as(
        None, "schedule_list", why="schedule_list has no effect in Levanter's SOAP; remove it"
    )

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """Clip, scale by SOAP, add decayed weights, scale by the scheduled learning rate."""
        parts = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(
            scale_by_soap(
                b1=self.beta1,
                b2=self.beta2,
                shampoo_beta=self.shampoo_beta if self.shampoo_beta >= 0 else self.beta2,
                epsilon=self.epsilon,
                precondition_frequency=self.precondition_frequency,
                max_precond_dim=self.max_precond_dim,
                merge_small_dims=self.merge_small_dims,
                target_merged_dim_size=self.target_merged_dim_size,
                one_diag=self.one_diag,
                block_size=self.block_size if self.partition_grads_into_blocks else None,
                mu_dtype=self.mu_dtype,
                precond_dtype=self.precond_dtype,
            )
        )
        parts += self.decayed_weights()
        parts.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps)))
        return optax.chain(*parts)
