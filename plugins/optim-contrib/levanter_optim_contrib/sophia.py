"""Sophia (Liu et al. 2023, https://arxiv.org/abs/2305.14342): ``type: sophia-h`` and
``type: sophia-g``.

Sophia divides a momentum of the gradients by an estimate of the Hessian's diagonal and clips
each coordinate of the result, so that a step moves no parameter by more than the learning
rate::

    m_t = beta1 m_{t-1} + (1 - beta1) g_t
    x_{t+1} = x_t - lr_t (clip(m_t / (1 - beta1^t) / max(gamma h, epsilon), clip_threshold) + wd x_t)
    h <- beta2 h + (1 - beta2) hhat(x_t)      after steps t = k, 2k, ...; k = update_interval

The estimate ``hhat`` is where the two variants differ, and it is why Sophia needs more from
the trainer than the gradients: both evaluate the training objective again, on the step's batch,
inside the compiled step (only on the steps that estimate, through ``jax.lax.cond``):

* Sophia-H, Hutchinson's estimator: ``hhat = v * (H v)`` for a random ``v`` (Gaussian, or
  Rademacher with ``random_vectors: rademacher``), the Hessian-vector product taken through the
  loss (``objective.loss``);
* Sophia-G, the Gauss-Newton-Bartlett estimator: ``hhat = B * ghat * ghat``, ``ghat`` the
  gradient of the loss against targets drawn from the model's own predictions
  (``objective.sampled_loss``) and ``B`` the number of predictions it averages over.

The estimate comes through the keyword argument ``objective`` that every optimizer's
``update`` receives (:mod:`levanter_core.optim.step`). Nothing here is particular to language
models.

The order of the steps is Levanter's (``levanter.optim.sophia``), so that the same parameters,
gradients and objective give the same updates (``tests/test_sophia_levanter.py`` checks 50
steps of each variant against updates Levanter's own code made; ``bench/sophia_levanter.py``
runs that comparison again). A step divides by the moving average of the *previous* estimates;
then, on every ``update_interval``-th step, a new estimate is made at the step's parameters
and enters the average for the steps after it. The first ``update_interval`` steps therefore
divide by ``epsilon``: they are clipped sign steps of the momentum, at the learning rate (which
is why Sophia's configs warm up). The estimates' random draws take their keys from one key in
the optimizer's state, ``PRNGKey(rng_seed)``, split at each estimate, as Levanter's
``hess_key``; being state, it is checkpointed, so a resumed run draws what the uninterrupted
one drew.

Differences from Levanter: Sophia-G, which Levanter leaves unimplemented (its
``stochastic_diag_gauss_newton`` raises ``NotImplementedError``), works here, as the paper's
Algorithm 2 and Levanter's unreachable code for it describe it; the Hessian-vector product is
taken reverse over reverse (Levanter's goes forward over reverse, which the fused
cross-entropy's custom gradient does not support); ``random_vectors: rademacher`` is a choice
Levanter does not offer.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from pydantic import Field

from levanter_core.optim import OptimizerConfig, hessian_vector_product
from levanter_core.tracker.jit_log import jit_log

PyTree = Any
Estimator = Callable[[Any, PyTree, jax.Array], PyTree]
"""``(objective, params, key) -> hhat``: one estimate of the Hessian's diagonal."""


class SophiaState(NamedTuple):
    count: jax.Array  # int32 scalar: updates made
    mu: PyTree  # momentum of the gradients
    h: PyTree  # moving average of the estimates of the Hessian's diagonal
    key: jax.Array  # split at each estimate: one half draws it, the other is kept (Levanter's hess_key)


def _random_like(key: jax.Array, params: PyTree, kind: str) -> PyTree:
    leaves, structure = jax.tree.flatten(params)
    draw = jax.random.normal if kind == "gaussian" else jax.random.rademacher
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(structure, [draw(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def hutchinson_estimate(random_vectors: str = "gaussian") -> Estimator:
    """Sophia-H's estimator: ``v * (H v)``, ``H`` the Hessian of the step's loss at ``params``."""

    def estimate(objective, params, key):
        v = _random_like(key, params, random_vectors)
        hv = hessian_vector_product(objective.loss, params, v)
        return jax.tree.map(lambda a, b: a * b, v, hv)

    return estimate


def gauss_newton_bartlett_estimate(objective, params, key):
    """Sophia-G's estimator: ``B * ghat * ghat``, ``ghat`` the gradient of the loss against
    targets drawn from the model's predictions, ``B`` the predictions it averages over."""
    ghat = jax.grad(objective.sampled_loss)(params, key)
    count = objective.data_points()
    return jax.tree.map(lambda g: count * g * g, ghat)


def scale_by_sophia(
    estimator: Estimator,
    *,
    b1: float,
    b2: float,
    epsilon: float,
    gamma: float,
    clip_threshold: float | None,
    update_interval: int,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Sophia's preconditioned, clipped momentum (the learning rate and weight decay are applied
    after it), in Levanter's order (see the module docstring). ``update`` needs the keyword
    argument ``objective`` (:class:`~levanter_core.optim.BatchObjective`); the estimates' keys
    come from ``PRNGKey(seed)``, kept in the state."""

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return SophiaState(jnp.zeros((), jnp.int32), zeros, zeros, jax.random.PRNGKey(seed))

    def update(grads, state, params=None, *, objective=None, **_):
        if params is None or objective is None:
            raise ValueError(
                "Sophia estimates the Hessian from the objective: its update needs params and "
                "objective= (levanter's trainer passes both; see levanter_core.optim.step)"
            )
        count = state.count + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
        correction = 1 - b1**count  # in the default float type: float64 under jax_enable_x64, as Levanter
        ratios = jax.tree.map(lambda m, hh: (m / correction) / jnp.maximum(gamma * hh, epsilon), mu, state.h)
        stats = {"optim/hessian_norm": optax.global_norm(state.h), "optim/momentum_norm": optax.global_norm(mu)}
        if clip_threshold is not None:
            leaves = jax.tree.leaves(ratios)
            inside = sum(jnp.sum(jnp.abs(r) < clip_threshold, dtype=jnp.float32) for r in leaves)
            stats["optim/unclipped_fraction"] = inside / sum(r.size for r in leaves)
            ratios = jax.tree.map(lambda r: jnp.clip(r, -clip_threshold, clip_threshold), ratios)
        jit_log(stats)

        def refresh(carry):
            h, key = carry
            draw, keep = jax.random.split(key)
            estimate = estimator(objective, params, draw)
            return jax.tree.map(lambda old, new: b2 * old + (1 - b2) * new.astype(old.dtype), h, estimate), keep

        # The estimate is the costly part (a Hessian-vector product, or a second backward pass):
        # the branch that makes it runs on every `update_interval`-th step only. Made after this
        # step's ratios, at the parameters this step starts from, it serves the steps after it.
        h, key = jax.lax.cond(count % update_interval == 0, refresh, lambda carry: carry, (state.h, state.key))
        return ratios, SophiaState(count, mu, h, key)

    return optax.GradientTransformationExtraArgs(init, update)


class SophiaConfig(OptimizerConfig, abc.ABC):
    """What Sophia-H and Sophia-G share. The learning rate bounds each parameter's step; with
    ``clip_threshold`` 1, a step moves no parameter by more than it (weight decay aside)."""

    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay, scaled by the learning rate (applied after the clipping, as in
    the paper's Algorithm 3). 0 turns it off."""
    beta1: float = Field(0.96, ge=0, lt=1)
    """Decay rate of the momentum of the gradients."""
    beta2: float = Field(0.99, ge=0, lt=1)
    """Decay rate of the moving average of the Hessian estimates (one term every
    ``update_interval`` steps)."""
    epsilon: float = Field(1e-12, gt=0)
    """Floor of the denominator ``gamma * h``."""
    clip_threshold: float | None = Field(1.0, gt=0)
    """Clip each coordinate of ``momentum / (gamma * h)`` to this magnitude. None: no clipping."""
    update_interval: int = Field(10, ge=1)
    """Estimate the Hessian's diagonal at the end of every this many steps, for the steps after
    it (until the first estimate, steps divide by ``epsilon``): the estimate costs about one more
    forward and backward pass."""
    rng_seed: int = 0
    """Seed of the estimates' random draws (``PRNGKey(rng_seed)``, split at each estimate, as in
    Levanter)."""
    gamma: float = Field(gt=0)
    """Scale of the Hessian estimate in the denominator: larger is more conservative."""

    @abc.abstractmethod
    def estimator(self) -> Estimator:
        """The estimate of the Hessian's diagonal this variant makes."""

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        parts = [
            scale_by_sophia(
                self.estimator(),
                b1=self.beta1,
                b2=self.beta2,
                epsilon=self.epsilon,
                gamma=self.gamma,
                clip_threshold=self.clip_threshold,
                update_interval=self.update_interval,
                seed=self.rng_seed,
            )
        ]
        parts += self.decayed_weights()
        parts.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps)))
        return optax.chain(*parts)


class SophiaHConfig(SophiaConfig):
    """Sophia-H: Sophia with Hutchinson's estimate of the Hessian's diagonal, ``v * (H v)``."""

    gamma: float = Field(0.01, gt=0)
    """Scale of the Hessian estimate in the denominator: larger is more conservative."""
    random_vectors: Literal["gaussian", "rademacher"] = "gaussian"
    """The distribution of Hutchinson's random vectors ``v``: ``gaussian`` (the paper's and
    Levanter's) or ``rademacher`` (random signs: less variance, optax's choice)."""

    def estimator(self) -> Estimator:
        return hutchinson_estimate(self.random_vectors)


class SophiaGConfig(SophiaConfig):
    """Sophia-G: Sophia with the Gauss-Newton-Bartlett estimate, ``B * ghat * ghat`` (``ghat`` the
    gradient of the loss against targets the model draws itself). Needs an objective that can
    draw targets (language modelling can)."""

    gamma: float = Field(0.05, gt=0)
    """Scale of the Hessian estimate in the denominator: larger is more conservative."""

    def estimator(self) -> Estimator:
        return gauss_newton_bartlett_estimate
