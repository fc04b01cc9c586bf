"""What the trainer hands an optimizer's ``update`` besides the gradients.

Every optimizer the trainer runs is called as::

    updates, state = optimizer.update(
        grads, state, params, loss=loss, objective=objective, key=key, step=step
    )

``optax.chain`` passes these keyword arguments on to each part that accepts extra
arguments (an ``optax.GradientTransformationExtraArgs``, whose ``update`` takes
``**extra_args``); plain optax transformations never see them. They are:

``loss``
    The step's loss (a float32 scalar), as ``skip_bad_steps`` reads it.
``objective``
    A :class:`BatchObjective`: the training objective on this step's batch as a function
    of the parameters, for optimizers that evaluate it again (Sophia's Hessian estimates,
    sharpness-aware steps). Nothing is computed unless the optimizer calls it; a call inside
    ``jax.lax.cond`` costs only on the steps whose branch runs.
``key``
    A PRNG key of this step's own, for the optimizer's randomness. It comes from the
    training key of the state, so a resumed run draws exactly what the uninterrupted run
    drew, and it is independent of the key the loss used.
``step``
    The number of optimizer steps completed before this one (an int32 scalar), for work done
    every few steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

PyTree = Any


class BatchObjective:
    """The training objective on one step's batch, as a function of the parameters.

    ``params`` are trees of the structure the optimizer's ``update`` receives (the trainable
    arrays; the rest of the model is held fixed). The objective is evaluated in the compute
    precision of ``trainer.mp``, on the whole batch, or on its first microbatch when the step
    splits the batch into microbatches (so that it fits in memory as the step's own
    gradients do).
    """

    def __init__(
        self,
        loss: Callable[[PyTree, jax.Array | None], jax.Array],
        sampled_loss: Callable[[PyTree, jax.Array], jax.Array],
        data_points: Callable[[], jax.Array],
    ):
        self._loss = loss
        self._sampled_loss = sampled_loss
        self._data_points = data_points

    def loss(self, params: PyTree, key: jax.Array | None = None) -> jax.Array:
        """The loss the step minimizes, at ``params`` (``key`` for dropout; None: none)."""
        return self._loss(params, key)

    def sampled_loss(self, params: PyTree, key: jax.Array) -> jax.Array:
        """The loss against targets drawn with ``key`` from the model's own predictions at
        ``params`` (:meth:`levanter_core.objective.Objective.sampled_loss`); its gradient is the
        Gauss-Newton-Bartlett estimator's. Raises ``NotImplementedError`` for an objective that
        cannot draw targets."""
        return self._sampled_loss(params, key)

    def data_points(self) -> jax.Array:
        """How many predictions the loss averages over in this batch (float32 scalar): token
        positions for language modelling."""
        return self._data_points()


def hessian_vector_product(f: Callable[[PyTree], jax.Array], params: PyTree, vector: PyTree) -> PyTree:
    """``H v`` for the Hessian ``H`` of the scalar function ``f`` at ``params``, as the gradient of
    ``<grad f, v>`` (reverse over reverse, which works through the fused cross-entropy's custom
    gradient, where forward mode does not)."""

    def directional(p):
        grads = eqx.filter_grad(f)(p)
        products = jax.tree.map(lambda g, v: (g * v).sum(), grads, vector)
        return sum(jax.tree.leaves(products))

    return eqx.filter_grad(directional)(params)
