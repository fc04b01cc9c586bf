"""Sophia (Liu et al. 2023, https://arxiv.org/abs/2305.14342): ``type: sophia-h`` and
``type: sophia-g``.

Sophia divides a momentum of the gradients by an estimate of the Hessian's diagonal and clips
each coordinate of the result, so that a step moves no parameter by more than the learning
rate::

    m_t = beta1 m_{t-1} + (1 - beta1) g_t
    h_t = beta2 h_{t-k} + (1 - beta2) hhat_t       every k = update_interval steps
    x_{t+1} = x_t - lr_t (clip(m_t / max(gamma h_t, epsilon), clip_threshold) + wd x_t)

The estimate ``hhat`` is where the two variants differ, and it is why Sophia needs more from
the trainer than the gradients: both evaluate the training objective again, on the step's batch,
inside the compiled step (only on the steps that estimate, through ``jax.lax.cond``):

* Sophia-H, Hutchinson's estimator: ``hhat = v * (H v)`` for a random ``v`` (Gaussian, or
  Rademacher with ``random_vectors: rademacher``), the Hessian-vector product taken through the
  loss (``objective.loss``);
* Sophia-G, the Gauss-Newton-Bartlett estimator: ``hhat = B * ghat * ghat``, ``ghat`` the
  gradient of the loss against targets drawn from the model's own predictions
  (``objective.sampled_loss``) and ``B`` the number of predictions it averages over.

Both come through the keyword arguments every optimizer's ``update`` receives
(:mod:`levanter_core.optim.step`): ``objective`` and ``key``. Nothing here is particular to
language models.

Differences from Levanter: the first estimate is made on the first step (Levanter makes it
after ``update_interval`` steps, and until then divides by ``epsilon``, so its first steps are
sign steps of the full learning rate); the estimate's randomness comes from the trainer's key
(``rng_seed`` is folded into it), so a resumed run draws what the uninterrupted one drew;
Sophia-G, which Levanter leaves unimplemented, works.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Literal, NamedTuple

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
    after it). ``update`` needs the keyword argument ``objective``
    (:class:`~levanter_core.optim.BatchObjective`); ``key`` (else a key made from ``seed`` and the
    step count) draws the estimates' randomness, ``seed`` being folded into it either way."""

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return SophiaState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(grads, state, params=None, *, objective=None, key=None, **_):
        if params is None or objective is None:
            raise ValueError(
                "Sophia estimates the Hessian from the objective: its update needs params and "
                "objective= (levanter's trainer passes both; see levanter_core.optim.step)"
            )
        count = state.count + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)

        def refresh(h):
            base = key if key is not None else jax.random.fold_in(jax.random.PRNGKey(0), state.count)
            estimate = estimator(objective, params, jax.random.fold_in(base, seed))
            return jax.tree.map(lambda old, new: b2 * old + (1 - b2) * new.astype(old.dtype), h, estimate)

        # The estimate is the costly part (a Hessian-vector product, or a second backward pass):
        # the branch that makes it runs every `update_interval` steps, starting with the first.
        h = jax.lax.cond(state.count % update_interval == 0, refresh, lambda h: h, state.h)
        correction = 1 - b1 ** count.astype(jnp.float32)
        ratios = jax.tree.map(lambda m, hh: (m / correction) / jnp.maximum(gamma * hh, epsilon), mu, h)
        stats = {"optim/hessian_norm": optax.global_norm(h), "optim/momentum_norm": optax.global_norm(mu)}
        if clip_threshold is not None:
            leaves = jax.tree.leaves(ratios)
            inside = sum(jnp.sum(jnp.abs(r) < clip_threshold, dtype=jnp.float32) for r in leaves)
            stats["optim/unclipped_fraction"] = inside / sum(r.size for r in leaves)
            ratios = jax.tree.map(lambda r: jnp.clip(r, -clip_threshold, clip_threshold), ratios)
        jit_log(stats)
        return ratios, SophiaState(count, mu, h)

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
    """Estimate the Hessian's diagonal every this many steps (on the first step, then every
    ``update_interval``): the estimate costs about one more forward and backward pass."""
    rng_seed: int = 0
    """Folded into the trainer's key for the estimates' random draws."""
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
