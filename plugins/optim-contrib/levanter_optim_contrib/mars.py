"""``type: mars``: MARS-AdamW, AdamW on a variance-reduced gradient.

MARS (Yuan et al. 2024, "MARS: Unleashing the Power of Variance Reduction for Training Large
Models", https://arxiv.org/abs/2411.10438), in its approximate form that reuses the previous
step's gradient instead of a second gradient evaluation. Each step it forms

    c_t = g_t + gamma * beta1 / (1 - beta1) * (g_t - g_{t-1})

scales ``c_t`` down to norm ``max_grad_norm`` when it is longer, and feeds it to AdamW.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu
from pydantic import Field

from levanter_core.optim.config import OptimizerConfig


class MarsConfig(OptimizerConfig):
    """MARS-AdamW (Yuan et al. 2024) with Levanter's fields and defaults.

    As in Levanter: the correction is applied to every parameter (the paper's reference code can
    leave vectors to plain AdamW), the previous gradient starts at zero (so the first step's
    ``c_1`` is ``g_1`` times ``1 + gamma * beta1 / (1 - beta1)``), and ``c_t`` is clipped by its
    global norm over all parameters at ``max_grad_norm`` (the paper clips each tensor at 1).
    Deviation: the clipping factor is ``max_grad_norm / |c_t|`` exactly, as in
    ``optax.clip_by_global_norm``, where Levanter divides by ``|c_t| + 1e-6``.
    """

    beta1: float = Field(0.95, ge=0, lt=1)
    """Decay rate of the running mean of the corrected gradients (Adam's first moment); it also
    sets the size of the correction, ``gamma * beta1 / (1 - beta1)``."""
    beta2: float = Field(0.99, ge=0, lt=1)
    """Decay rate of the running mean of the squared corrected gradients (Adam's second moment)."""
    gamma: float = Field(0.025, ge=0)
    """Strength of the variance reduction: the weight of the change in gradient since the last
    step (times ``beta1 / (1 - beta1)``). 0 gives plain AdamW with gradient clipping."""
    epsilon: float = Field(1e-8, ge=0)
    """Added to the root of the second moment before dividing, for numerical stability."""
    max_grad_norm: float | None = Field(1.0, ge=0)
    """Scale the corrected gradient ``c_t`` down so its global L2 norm is at most this. None or 0
    turns clipping off."""

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """MARS scaling, decayed weights, then the scheduled learning rate."""
        parts = [scale_by_mars(self.beta1, self.beta2, self.gamma, self.epsilon, self.max_grad_norm or None)]
        parts += self.decayed_weights()
        parts.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps)))
        return optax.chain(*parts)


class ScaleByMarsState(NamedTuple):
    """State of :func:`scale_by_mars`."""

    count: jax.Array
    """Steps taken (int32 scalar), for Adam's bias correction."""
    mu: optax.Updates
    """Running mean of the clipped corrected gradients."""
    nu: optax.Updates
    """Running mean of their squares."""
    previous_grad: optax.Updates
    """The raw gradient of the last step (zeros before the first)."""


def scale_by_mars(
    b1: float, b2: float, gamma: float, eps: float, max_norm: float | None
) -> optax.GradientTransformation:
    """Adam's scaling (with bias correction) applied to MARS's corrected gradient ``c_t``, which
    is clipped to global norm ``max_norm`` first (None: never clipped). Works leaf-wise, so on
    NamedArray trees as on plain arrays."""
    correction = gamma * b1 / (1 - b1)

    def init_fn(params):
        return ScaleByMarsState(
            count=jnp.zeros([], jnp.int32),
            mu=otu.tree_zeros_like(params),
            nu=otu.tree_zeros_like(params),
            previous_grad=otu.tree_zeros_like(params),
        )

    def update_fn(updates, state, params=None):
        del params
        c = jax.tree.map(lambda g, prev: g + correction * (g - prev), updates, state.previous_grad)
        if max_norm is not None:
            norm = optax.global_norm(c)
            # 1 up to max_norm, max_norm / norm beyond; never a division by zero
            factor = max_norm / jnp.maximum(norm, max_norm)
            c = jax.tree.map(lambda x: x * factor.astype(x.dtype), c)
        mu = otu.tree_update_moment(c, state.mu, b1, 1)
        nu = otu.tree_update_moment_per_elem_norm(c, state.nu, b2, 2)
        count = optax.safe_increment(state.count)
        mu_hat = otu.tree_bias_correction(mu, b1, count)
        nu_hat = otu.tree_bias_correction(nu, b2, count)
        scaled = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return scaled, ScaleByMarsState(count=count, mu=mu, nu=nu, previous_grad=updates)

    return optax.GradientTransformation(init_fn, update_fn)
