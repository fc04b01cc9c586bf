"""PSGD Kron (Xi-Lin Li, "Preconditioned stochastic gradient descent", 2018; the Kron variant of
https://github.com/lixilinx/psgd_torch, as Evan Walters' JAX version has it): ``type: kron``.

Each parameter tensor ``G`` of shape ``(d_1, ..., d_n)`` gets a preconditioner that is a Kronecker
product ``P = Q_1^T Q_1 (x) ... (x) Q_n^T Q_n``: one upper-triangular ``Q_i`` (``d_i x d_i``) or,
for a large dimension, a diagonal one per dimension. The step direction is ``P m``, each
``Q_i^T Q_i`` applied along its own dimension of the (bias-corrected momentum) ``m``. From time
to time ``P`` is fitted to the momentum by one step on each ``Q_i`` of the whitening criterion
``E[h^T P h + v^T P^-1 v]``, with a random probe ``v ~ N(0, I)`` and ``h = m + damping * v``::

    A = (Q_1 (x) ... (x) Q_n) h              B = (Q_1^-T (x) ... (x) Q_n^-T) v
    Q_i <- Q_i - lr / |A_(i) A_(i)^T + B_(i) B_(i)^T| * triu(A_(i) A_(i)^T - B_(i) B_(i)^T) Q_i

where ``X_(i)`` is ``X`` unfolded along dimension ``i`` (a ``d_i x (size / d_i)`` matrix) and
``|.|`` a cheap estimate of the spectral norm (for a diagonal ``Q_i`` the same with the diagonal
of each Gram matrix and its maximum). All ``Q_i`` are updated from the same ``A`` and ``B``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import haliax.nn as hnn
import jax
import jax.numpy as jnp
import optax
from pydantic import Field

from levanter_core.config.base import accepted_only_as
from levanter_core.optim import OptimizerConfig
from levanter_optim_contrib.fields import FloatDtype

PyTree = Any
Precision = Literal["bfloat16", "tensorfloat32", "float32"]

_DAMPING = math.sqrt(float(jnp.finfo(jnp.float32).eps))  # relative to the mean |momentum|; bf16's eps is too coarse
_BALANCE_EVERY = 100  # preconditioner updates between rescalings of the factors
_UPDATE_RMS_LIMIT = 1.1  # Levanter clips each layer's Kron direction to this RMS


class KronConfig(OptimizerConfig):
    """PSGD Kron: momentum preconditioned by a Kronecker product of per-dimension triangular
    (or diagonal) factors, fitted to the momentum with random probes (see the module
    docstring). Every parameter is Kron's, as in Levanter (no AdamW part): one-dimensional ones
    (biases, norms) and dimensions larger than ``max_size_triangular`` get diagonal factors.

    Each step: clip the gradient norm (unless ``normalize_grads``), update the momentum, with
    probability ``p_t`` refit the preconditioner, precondition, clip each layer's direction to an
    RMS of 1.1, add decayed weights, scale by the learning rate. Each layer of stacked blocks
    (a leading ``layers`` axis) has its own preconditioner.

    Randomness comes from the ``key`` the trainer passes to every update (or, without one, a
    key kept in the optimizer state), so a resumed run makes the same draws.

    Differences from Levanter: whether to refit on a step is a draw with probability ``p_t``
    (Levanter refits every ``1/p_t``-th step by a counter, which makes any ``p_t`` between 1/2
    and 1 a refit every other step); for stacked blocks, ``normalize_grads``, the damping scale
    and the RMS clip are per layer (Levanter's span all layers at once, so stacking changed
    the result); with ``partition_grads_into_blocks`` the edge blocks are smaller instead of
    zero-padded to ``block_size`` (the padding took random probes and nudged the real
    entries' factors); the factors are computed in float32 whatever ``precond_dtype`` stores;
    ``max_grad_norm`` is turned off by null (not 0), as in the core's AdamW;
    ``params_sharding`` and ``preconditioner_sharding`` are not accepted (below).
    """

    beta1: float = Field(0.9, ge=0, lt=1)
    """Decay rate of the momentum (a bias-corrected running mean of gradients) that is
    preconditioned. 0: no momentum, the gradient itself."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip gradients so their global L2 norm is at most this, unless ``normalize_grads``. None
    turns clipping off."""
    normalize_grads: bool = False
    """Divide each parameter's gradient (each layer's, for stacked blocks) by its L2 norm
    before the momentum, instead of clipping by ``max_grad_norm``. Can help stability."""
    preconditioner_update_probability: float = Field(0.05, gt=0, le=1)
    """The floor of the probability of refitting the preconditioner on a step. The probability
    is 1 for the first ``update_prob_flat_start`` steps, then decays as
    ``exp(-0.001 (step - update_prob_flat_start))`` until it reaches this floor (about 3,000
    steps later for 0.05). Refits are the costly part of a step."""
    update_prob_flat_start: int = Field(500, ge=0)
    """Steps at the start of training during which the preconditioner is refitted every step,
    before the probability starts to decay. Longer helps the preconditioner while the loss
    falls fast, at the cost of slower steps."""
    max_size_triangular: int = Field(25000, ge=0)
    """A dimension larger than this gets a diagonal factor instead of a triangular one (whose
    size is the dimension squared)."""
    min_ndim_triangular: int = Field(2, ge=0)
    """A parameter with fewer dimensions than this (after leaving out the ``layers`` axis of
    stacked blocks) gets diagonal factors only: with 2, biases and norms do."""
    memory_save_mode: Literal["one_diag", "all_diag"] | None = None
    """Trade preconditioner quality for memory. None: triangular factors wherever the rules above
    allow; ``one_diag``: the largest dimension of each parameter (the last of equal ones) is
    diagonal; ``all_diag``: every factor is diagonal."""
    preconditioner_lr: float = Field(0.1, ge=0)
    """Step size of each refit of the factors ``Q_i`` (relative to their normalized gradient)."""
    preconditioner_init_scale: float = Field(1.0, gt=0)
    """The preconditioner starts as this times the identity (each of the ``n`` factors of an
    ``n``-dimensional block as ``scale^(1/n)`` times the identity)."""
    mu_dtype: FloatDtype = None
    """Dtype in which the momentum is stored (e.g. ``bfloat16``). None: the parameter's."""
    precond_dtype: FloatDtype = None
    """Dtype in which the factors ``Q_i`` are stored (e.g. ``bfloat16``). None: float32. They
    are computed in float32 either way."""
    precond_update_precision: Precision | None = "tensorfloat32"
    """Matmul precision of the refits (``bfloat16``, ``tensorfloat32`` or ``float32``; JAX's
    ``default_matmul_precision``). None: the backend's default. No effect on CPU."""
    precond_grads_precision: Precision | None = None
    """Matmul precision of applying the preconditioner to the momentum, as
    ``precond_update_precision``. None: the backend's default."""
    lax_map_scanned_layers: bool = False
    """Go over the layers of stacked blocks (and over the blocks of ``partition_grads_into_blocks``)
    with ``jax.lax.map`` in batches of ``lax_map_batch_size`` instead of all at once with
    ``vmap``: slower, but needs less memory for large models."""
    lax_map_batch_size: int = Field(8, ge=1)
    """How many layers or blocks ``lax_map_scanned_layers`` processes at once."""
    merge_small_dims: bool = True
    """Reshape each parameter by merging adjacent dimensions (e.g. ``heads`` and ``head_size``)
    into ones close to ``target_merged_dim_size`` before preconditioning: fewer, better sized
    factors. Which dimensions merge minimizes a cost that grows fast for dimensions below 1/8
    or above 8 times the target."""
    target_merged_dim_size: int = Field(8192, ge=1)
    """The dimension size ``merge_small_dims`` aims for."""
    partition_grads_into_blocks: bool = True
    """Cut each (merged) dimension with a triangular factor that is larger than ``block_size``
    into blocks of ``block_size`` (the last one smaller when it does not divide), and give every
    block its own preconditioner: a block-diagonal approximation that keeps factors small.
    Dimensions with diagonal factors are not cut."""
    block_size: int = Field(256, ge=1)
    """Size of the blocks of ``partition_grads_into_blocks``."""
    params_sharding: Any = None
    """Levanter's tree of ``PartitionSpec`` for the parameters; only null is accepted: the
    parameters' sharding comes from their named axes and the trainer's axis mappings."""
    preconditioner_sharding: Any = None
    """Levanter's ``PartitionSpec`` for the factors; only null is accepted: XLA places them
    inside a step, and at rest they are stored whole on every device (Levanter ignored this
    setting whenever Haliax was installed, as it always is)."""

    _no_sharding_fields = accepted_only_as(
        None,
        "params_sharding",
        "preconditioner_sharding",
        why="params_sharding and preconditioner_sharding are not supported (sharding follows the "
        "parameters' named axes and the trainer's axis mappings); remove the field or set it to null",
    )

    def build(self, num_train_steps: int) -> optax.GradientTransformationExtraArgs:
        """Clip, Kron (momentum and preconditioning), clip each layer's RMS, add decayed
        weights, scale by the scheduled learning rate."""
        parts = []
        if self.max_grad_norm is not None and not self.normalize_grads:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(
            scale_by_kron(
                beta1=self.beta1,
                normalize_grads=self.normalize_grads,
                update_probability=update_probability_schedule(
                    self.preconditioner_update_probability, self.update_prob_flat_start
                ),
                max_size_triangular=self.max_size_triangular,
                min_ndim_triangular=self.min_ndim_triangular,
                memory_save_mode=self.memory_save_mode,
                preconditioner_lr=self.preconditioner_lr,
                preconditioner_init_scale=self.preconditioner_init_scale,
                mu_dtype=self.mu_dtype,
                precond_dtype=self.precond_dtype,
                precond_update_precision=self.precond_update_precision,
                precond_grads_precision=self.precond_grads_precision,
                lax_map=self.lax_map_scanned_layers,
                lax_map_batch_size=self.lax_map_batch_size,
                target_merged_dim_size=self.target_merged_dim_size if self.merge_small_dims else None,
                block_size=self.block_size if self.partition_grads_into_blocks else None,
            )
        )
        parts.append(clip_by_layer_rms(_UPDATE_RMS_LIMIT))
        parts += self.decayed_weights()
        parts.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps)))
        return optax.chain(*parts)


def update_probability_schedule(
    min_prob: float, flat_start: int, max_prob: float = 1.0, decay: float = 0.001
) -> Callable[[jax.Array], jax.Array]:
    """``step -> probability of refitting the preconditioner``: ``max_prob`` up to step
    ``flat_start``, then ``max_prob * exp(-decay (step - flat_start))``, never below ``min_prob``.
    A preconditioner needs many refits early and few once it has been learned."""

    def schedule(step):
        return jnp.clip(max_prob * jnp.exp(-decay * (step - flat_start)), min_prob, max_prob)

    return schedule


class KronState(NamedTuple):
    """:func:`scale_by_kron`'s state: arrays only, checkpointed like the parameters."""

    count: jax.Array  # int32: steps taken
    key: jax.Array  # the draws of calls without a `key` argument
    balance_count: jax.Array  # int32: refits since the factors were last rescaled
    mu: PyTree  # the momentum (None without beta1)
    factors: tuple  # per parameter, per group of equally shaped blocks, per dimension: Q_i, stacked over blocks


def scale_by_kron(
    *,
    beta1: float = 0.9,
    normalize_grads: bool = False,
    update_probability: float | Callable[[jax.Array], jax.Array] = 1.0,
    max_size_triangular: int = 25000,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    preconditioner_lr: float = 0.1,
    preconditioner_init_scale: float = 1.0,
    mu_dtype: Any = None,
    precond_dtype: Any = None,
    precond_update_precision: str | None = "tensorfloat32",
    precond_grads_precision: str | None = None,
    lax_map: bool = False,
    lax_map_batch_size: int = 8,
    target_merged_dim_size: int | None = None,
    block_size: int | None = None,
    probe: Callable[[jax.Array, tuple[int, ...]], jax.Array] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The Kron direction ``P m`` of each parameter, for any tree of arrays or Haliax module
    (each layer of a ``haliax.nn.Stacked`` gets its own preconditioner). Arguments are
    :class:`KronConfig`'s, except: ``update_probability`` is a number or a function of the
    step count (1 on the first step); ``target_merged_dim_size=None`` merges no dimensions;
    ``block_size=None`` cuts no blocks; ``probe(key, shape)`` draws the random probes of one
    parameter, shaped ``(layers, *one layer's shape)`` (default: standard normal, float32).

    ``update(..., key=k)`` decides whether to refit with ``split(k)[0]`` and draws parameter
    ``i``'s probes with ``fold_in(split(k)[1], i)``; without a ``key`` it splits one off the key
    in the state.
    """
    if memory_save_mode not in (None, "one_diag", "all_diag"):
        raise ValueError(f"memory_save_mode must be None, 'one_diag' or 'all_diag', not {memory_save_mode!r}")
    schedule = update_probability if callable(update_probability) else lambda _: update_probability
    factor_dtype = jnp.dtype(precond_dtype or jnp.float32)
    layout = functools.partial(
        _layout,
        max_size_triangular=max_size_triangular,
        min_ndim_triangular=min_ndim_triangular,
        memory_save_mode=memory_save_mode,
        target_merged_dim_size=target_merged_dim_size,
        block_size=block_size,
    )

    def layouts(tree) -> list[_Layout]:
        return [layout(x.shape, depth) for x, depth in zip(jax.tree.leaves(tree), _stack_depths(tree))]

    def batched(fn):
        if lax_map:
            return lambda *args: jax.lax.map(lambda xs: fn(*xs), args, batch_size=lax_map_batch_size)
        return jax.vmap(fn)

    def init(params):
        mu = None
        if beta1 > 0:
            mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype or p.dtype), params)
        factors = tuple(_initial_factors(lay, preconditioner_init_scale, factor_dtype) for lay in layouts(params))
        zero = jnp.zeros([], jnp.int32)
        return KronState(zero, jax.random.PRNGKey(0), zero, mu, factors)

    def update(updates, state, params=None, *, key=None, **extra_args):
        del params, extra_args
        count = optax.safe_increment(state.count)
        next_key = state.key
        if key is None:
            next_key, key = jax.random.split(state.key)
        decide_key, probe_key = jax.random.split(key)
        leaves, treedef = jax.tree.flatten(updates)
        lays = layouts(updates)
        # every tensor as (layers, *merged shape of one layer), in float32
        grads = [g.astype(jnp.float32).reshape((lay.layers, *lay.shape)) for g, lay in zip(leaves, lays)]
        if normalize_grads:
            grads = [g / (jnp.sqrt(_per_layer(jnp.sum, g * g)) + 1e-16) for g in grads]

        mu = state.mu
        if beta1 > 0:
            old = jax.tree.leaves(state.mu)
            moments = [beta1 * m.astype(jnp.float32).reshape(g.shape) + (1 - beta1) * g for m, g in zip(old, grads)]
            mu = treedef.unflatten([m.reshape(o.shape).astype(o.dtype) for m, o in zip(moments, old)])
            grads = [m / (1 - beta1 ** count.astype(jnp.float32)) for m in moments]

        def balance_all(factors):
            return tuple(tuple(batched(_balance)(group) for group in leaf) for leaf in factors)

        def refit(factors, balance_count):
            balance_count = balance_count + 1
            due = balance_count >= _BALANCE_EVERY
            factors = jax.lax.cond(due, balance_all, lambda fs: fs, factors)
            new = []
            with _matmul_precision(precond_update_precision):
                for i, (g, lay, fs) in enumerate(zip(grads, lays, factors)):
                    v = (probe or _normal_probe)(jax.random.fold_in(probe_key, i), (lay.layers, *lay.tensor_shape))
                    v = v.astype(jnp.float32).reshape(g.shape)
                    h = g + _DAMPING * _per_layer(jnp.mean, jnp.abs(g)) * v
                    step = functools.partial(_refit, lr=preconditioner_lr)
                    new.append(
                        tuple(batched(step)(f, hb, vb) for f, hb, vb in zip(fs, _to_blocks(h, lay), _to_blocks(v, lay)))
                    )
            return tuple(new), jnp.where(due, 0, balance_count)

        do_refit = jax.random.uniform(decide_key) < schedule(count)
        factors, balance_count = jax.lax.cond(
            do_refit, refit, lambda fs, n: (fs, n), state.factors, state.balance_count
        )

        directions = []
        with _matmul_precision(precond_grads_precision):
            for g, lay, fs, leaf in zip(grads, lays, factors, leaves):
                blocks = [batched(_precondition)(f, b) for f, b in zip(fs, _to_blocks(g, lay))]
                directions.append(_from_blocks(blocks, lay).reshape(leaf.shape).astype(leaf.dtype))
        new_state = KronState(count, next_key, balance_count, mu, factors)
        return treedef.unflatten(directions), new_state

    return optax.GradientTransformationExtraArgs(init, update)


def clip_by_layer_rms(threshold: float) -> optax.GradientTransformation:
    """Scale each parameter's update (each layer's, for stacked blocks) down to an RMS of at
    most ``threshold``; as ``optax.clip_by_block_rms`` for unstacked parameters."""

    def update(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        clipped = []
        for u, depth in zip(leaves, _stack_depths(updates)):
            x = u.astype(jnp.float32)
            rms = jnp.sqrt(jnp.mean(x * x, axis=tuple(range(depth, u.ndim)), keepdims=True))
            clipped.append((x / jnp.maximum(1.0, rms / threshold)).astype(u.dtype))
        return treedef.unflatten(clipped), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# -- which parameters are stacked -----------------------------------------------------------


def _stack_depths(tree: PyTree, depth: int = 0) -> list[int]:
    """For each array of ``tree`` (in ``jax.tree.leaves`` order): how many ``haliax.nn.Stacked``
    hold it, i.e. how many leading axes are layer axes rather than the tensor's own."""
    if isinstance(tree, hnn.Stacked):
        return _stack_depths(tree.stacked, depth + 1)
    depths = []
    for node in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, hnn.Stacked)):
        depths.extend(_stack_depths(node, depth) if isinstance(node, hnn.Stacked) else [depth])
    return depths


# -- how a parameter is cut into preconditioned blocks --------------------------------------


class _Layout(NamedTuple):
    """How one parameter is preconditioned (all static)."""

    layers: int  # layers of stacked blocks (product of the leading layer axes), else 1
    tensor_shape: tuple[int, ...]  # one layer's shape (a scalar as (1,))
    shape: tuple[int, ...]  # one layer's shape after merging dimensions
    diagonal: tuple[bool, ...]  # per dimension of `shape`: a diagonal factor?
    # groups of equally shaped blocks: per dimension (start, number of blocks, block size)
    groups: tuple[tuple[tuple[int, int, int], ...], ...]


def _layout(
    shape,
    depth,
    *,
    max_size_triangular,
    min_ndim_triangular,
    memory_save_mode,
    target_merged_dim_size,
    block_size,
) -> _Layout:
    tensor = tuple(shape[depth:]) or (1,)
    diagonal = _diagonal_dims(tensor, max_size_triangular, min_ndim_triangular, memory_save_mode)
    merged = tensor
    if target_merged_dim_size is not None:
        merged, diagonal = _merge_dims(tensor, diagonal, target_merged_dim_size)
    pieces = []
    for size, diag in zip(merged, diagonal):
        if block_size is None or diag or size <= block_size:
            pieces.append(((0, 1, size),))
        else:
            whole, rest = divmod(size, block_size)
            pieces.append(((0, whole, block_size),) + (((whole * block_size, 1, rest),) if rest else ()))
    return _Layout(math.prod(shape[:depth]), tensor, merged, diagonal, tuple(itertools.product(*pieces)))


def _diagonal_dims(shape, max_size, min_ndim, memory_save_mode) -> tuple[bool, ...]:
    diagonal = [memory_save_mode == "all_diag"] * len(shape)
    if memory_save_mode == "one_diag":
        diagonal[max(range(len(shape)), key=lambda i: (shape[i], i))] = True
    return tuple(d or size == 1 or size > max_size or len(shape) < min_ndim for d, size in zip(diagonal, shape))


def _merge_cost(size: int, target: int) -> float:
    """Levanter's heuristic: smallest at ``target``, steep below ``target / 8`` and above ``8 target``."""
    if size < target:
        return math.log2(target / size) + 100 * max(0.0, math.log2(target / 8 / size))
    return 10 * math.log2(size / target) + 1000 * max(0.0, math.log2(size / (8 * target)))


def _runs(start: int, stop: int):
    """Every way to cut ``range(start, stop)`` into consecutive runs, as ``(start, end)`` pairs."""
    if start == stop:
        yield ()
    for end in range(start + 1, stop + 1):
        for rest in _runs(end, stop):
            yield ((start, end),) + rest


def _merge_dims(shape, diagonal, target) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """``shape`` with runs of adjacent dimensions merged to minimize :func:`_merge_cost`; a merged
    dimension is diagonal when all its parts were."""
    if all(size == 1 for size in shape):
        return (1,), (True,)
    best = min(_runs(0, len(shape)), key=lambda runs: sum(_merge_cost(math.prod(shape[a:b]), target) for a, b in runs))
    return tuple(math.prod(shape[a:b]) for a, b in best), tuple(all(diagonal[a:b]) for a, b in best)


def _group_slices(group) -> tuple[slice, ...]:
    return (slice(None),) + tuple(slice(start, start + n * size) for start, n, size in group)


def _to_blocks(x: jax.Array, lay: _Layout) -> list[jax.Array]:
    """``x`` of shape ``(layers, *lay.shape)`` as one array per group: ``(layers * blocks, *block)``."""
    out = []
    for group in lay.groups:
        piece = x[_group_slices(group)]
        piece = piece.reshape((lay.layers,) + tuple(d for _, n, size in group for d in (n, size)))
        k = len(group)
        piece = piece.transpose((0, *range(1, 2 * k, 2), *range(2, 2 * k + 1, 2)))
        out.append(piece.reshape((-1,) + tuple(size for _, _, size in group)))
    return out


def _from_blocks(blocks: list[jax.Array], lay: _Layout) -> jax.Array:
    """The inverse of :func:`_to_blocks`."""
    pieces = []
    for piece, group in zip(blocks, lay.groups):
        k = len(group)
        piece = piece.reshape((lay.layers,) + tuple(n for _, n, _ in group) + tuple(size for _, _, size in group))
        piece = piece.transpose((0, *(axis for i in range(1, k + 1) for axis in (i, i + k))))
        pieces.append(piece.reshape((lay.layers,) + tuple(n * size for _, n, size in group)))
    if len(pieces) == 1:  # a single group covers the whole tensor
        return pieces[0]
    out = jnp.zeros((lay.layers, *lay.shape), pieces[0].dtype)
    for piece, group in zip(pieces, lay.groups):
        out = out.at[_group_slices(group)].set(piece)
    return out


def _initial_factors(lay: _Layout, scale: float, dtype) -> tuple:
    groups = []
    for group in lay.groups:
        count = lay.layers * math.prod(n for _, n, _ in group)
        q = scale ** (1 / len(group))
        groups.append(
            tuple(
                jnp.full((count, size), q, dtype) if diag else jnp.tile(q * jnp.eye(size, dtype=dtype), (count, 1, 1))
                for (_, _, size), diag in zip(group, lay.diagonal)
            )
        )
    return tuple(groups)


# -- the math of one block ------------------------------------------------------------------


def _along(q: jax.Array, x: jax.Array, axis: int, transpose: bool = False) -> jax.Array:
    """``Q x`` (or ``Q^T x``) along ``axis`` of ``x``; a diagonal ``Q`` is a vector."""
    if q.ndim == 1:
        return x * q.reshape((-1,) + (1,) * (x.ndim - axis - 1))
    return jnp.moveaxis(jnp.tensordot(q, x, axes=(0 if transpose else 1, axis)), 0, axis)


def _solve_along(q: jax.Array, x: jax.Array, axis: int) -> jax.Array:
    """``Q^-T x`` along ``axis`` of ``x``, by a triangular solve."""
    if q.ndim == 1:
        return x / q.reshape((-1,) + (1,) * (x.ndim - axis - 1))
    moved = jnp.moveaxis(x, axis, 0)
    y = jax.lax.platform_dependent(q, moved.reshape(q.shape[0], -1), cpu=_substitution_solve, default=_blas_solve)
    return jnp.moveaxis(y.reshape(moved.shape), 0, axis)


def _blas_solve(q: jax.Array, b: jax.Array) -> jax.Array:
    """``Q^-T b`` for upper-triangular ``Q``, by the backend's triangular solve."""
    return jax.lax.linalg.triangular_solve(q, b, left_side=True, lower=False, transpose_a=True)


def _substitution_solve(q: jax.Array, b: jax.Array) -> jax.Array:
    """``Q^-T b`` for upper-triangular ``Q``, by forward substitution in a loop: on CPU, XLA's
    LAPACK triangular solve inside the refit's ``lax.cond`` hung a jitted training step (jax
    0.10), and CPUs only run small models."""

    def row(i, y):  # rows of y from i on are still 0, so the dot sums over j < i only
        return y.at[i].set((b[i] - q[:, i] @ y) / q[i, i])

    return jax.lax.fori_loop(0, q.shape[0], row, jnp.zeros_like(b))


def _gram(x: jax.Array, axis: int, diagonal: bool) -> jax.Array:
    """``X_(axis) X_(axis)^T`` (only its diagonal if ``diagonal``), ``X_(axis)`` being ``x``
    unfolded along ``axis``."""
    unfolded = jnp.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)
    return jnp.sum(unfolded * unfolded, axis=1) if diagonal else unfolded @ unfolded.T


def _norm_estimate(m: jax.Array) -> jax.Array:
    """The spectral norm of the symmetric positive semi-definite ``m``, from below (within about a
    factor sqrt(2)): one power iteration started at its largest column."""
    scale = jnp.max(jnp.abs(m))
    m = m / jnp.where(scale > 0, scale, 1)
    x = m @ m[:, jnp.argmax(jnp.sum(m * m, axis=0))]
    estimate = scale * jnp.linalg.norm(m @ (x / jnp.linalg.norm(x)))
    return jnp.where(scale > 0, estimate, 0)


def _refit(factors: tuple, h: jax.Array, v: jax.Array, lr: float) -> tuple:
    """One step of every factor on the whitening criterion, for the damped momentum ``h`` and
    probe ``v`` of one block."""
    qs = [q.astype(jnp.float32) for q in factors]
    a, b = h, v
    for i, q in enumerate(qs):
        a, b = _along(q, a, i), _solve_along(q, b, i)
    tiny = jnp.finfo(jnp.float32).tiny
    new = []
    for i, (q, old) in enumerate(zip(qs, factors)):
        ga, gb = _gram(a, i, q.ndim == 1), _gram(b, i, q.ndim == 1)
        if q.ndim == 1:
            q = q - lr / (jnp.max(ga + gb) + tiny) * (ga - gb) * q
        else:
            q = q - lr / (_norm_estimate(ga + gb) + tiny) * jnp.triu(ga - gb) @ q
        new.append(q.astype(old.dtype))
    return tuple(new)


def _precondition(factors: tuple, g: jax.Array) -> jax.Array:
    """``P g``: ``Q_i^T Q_i`` applied along each dimension ``i`` of one block."""
    for i, q in enumerate(factors):
        q = q.astype(jnp.float32)
        g = _along(q, _along(q, g, i), i, transpose=True)
    return g


def _balance(factors: tuple) -> tuple:
    """Rescale the factors of one block to equal largest entries, keeping their product (and so
    the preconditioner): without it one factor may drift large and another small."""
    norms = jnp.stack([jnp.max(jnp.abs(q)).astype(jnp.float32) for q in factors])
    target = jnp.exp(jnp.mean(jnp.log(norms)))
    return tuple((q.astype(jnp.float32) * (target / n)).astype(q.dtype) for q, n in zip(factors, norms))


def _per_layer(reduce, x: jax.Array) -> jax.Array:
    """``reduce`` over all but the leading layer axis, kept for broadcasting."""
    return reduce(x, axis=tuple(range(1, x.ndim)), keepdims=True)


def _normal_probe(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32)


def _matmul_precision(name: str | None):
    return jax.default_matmul_precision(name) if name else contextlib.nullcontext()
