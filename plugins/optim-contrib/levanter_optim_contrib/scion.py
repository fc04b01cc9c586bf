"""Scion (Pethick et al. 2025, "Training Deep Learning Models with Norm-Constrained LMOs",
https://arxiv.org/abs/2502.07529): ``type: scion``.

Scion moves each parameter along the linear minimization oracle (LMO) of a norm ball, applied
to a momentum of the gradients: the step of length ``lr`` that decreases the linearized loss
most within that norm. With momentum ``d_t = (1 - alpha) d_{t-1} + alpha g_t``
(``alpha = 1 - momentum``) and the unconstrained update ``x_{t+1} = x_t + lr_t lmo(d_t)``
(the paper's uScion), the norms are, as in Levanter:

* the weight matrices of the hidden linear layers: a scaled spectral norm, whose LMO is
  ``-scale U V^T`` for ``d_t = U S V^T``, with ``scale = sqrt(max(1, d_out / d_in))`` as in
  Levanter (the paper's is ``sqrt(d_out / d_in)``, which differs only for matrices that
  narrow); ``U V^T`` is computed by Newton-Schulz iterations
  (:mod:`levanter_optim_contrib.orthogonalize`);
* everything else (embeddings, the LM head, norms, biases): the max-norm, whose LMO is
  ``-sign(d_t)`` (signum), with a learning rate ``scion_to_signum_lr`` times smaller or larger,
  its own momentum ``beta1``, and the gradients clipped first (``max_grad_norm``).

Decoupled weight decay ``lr_t weight_decay x_t`` is subtracted on top, where the weight-decay
mask selects (the paper's constrained Scion would instead shrink every parameter by
``(1 - lr_t)``).
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from pydantic import Field, model_validator

from levanter_core.optim import OptimizerConfig
from levanter_optim_contrib.orthogonalize import label_matrices, map_matrices, orthogonalized

PyTree = Any


class ScionMomentumState(NamedTuple):
    momentum: PyTree  # d_t, an exponential moving average of the gradients


def _average(decay: float, state: ScionMomentumState, grads: PyTree) -> PyTree:
    return jax.tree.map(lambda d, g: decay * d + (1 - decay) * g, state.momentum, grads)


def scale_by_spectral_lmo(momentum: float = 0.95, steps: int = 10, eps: float = 1e-8) -> optax.GradientTransformation:
    """Scion's direction for trees whose arrays are all weight matrices (as
    :func:`~levanter_optim_contrib.orthogonalize.map_matrices` finds them): the moving average
    of the gradients, orthogonalized by ``steps`` Newton-Schulz iterations and scaled by
    ``sqrt(max(1, d_out / d_in))`` (the negative of the spectral LMO; the learning rate is
    applied after it)."""
    orthogonalize = orthogonalized(steps, eps)

    def init(params):
        return ScionMomentumState(optax.tree.zeros_like(params))

    def update(grads, state, params=None):
        del params
        avg = _average(momentum, state, grads)
        return map_matrices(orthogonalize, avg), ScionMomentumState(avg)

    return optax.GradientTransformation(init, update)


def scale_by_sign_lmo(momentum: float = 0.9) -> optax.GradientTransformation:
    """Signum: the sign of the moving average of the gradients (the negative of the max-norm
    LMO)."""

    def init(params):
        return ScionMomentumState(optax.tree.zeros_like(params))

    def update(grads, state, params=None):
        del params
        avg = _average(momentum, state, grads)
        return jax.tree.map(jnp.sign, avg), ScionMomentumState(avg)

    return optax.GradientTransformation(init, update)


class ScionConfig(OptimizerConfig):
    """Scion: spectral-norm steps (orthogonalized momentum) for the weight matrices of the
    hidden linear layers, sign steps (signum) for the other parameters.

    ``learning_rate`` (with the shared schedule) is the matrices'; the other parameters get
    ``learning_rate * scion_to_signum_lr`` on the same schedule. Which parameters are which
    follows Levanter: the weights of linear layers (``haliax.nn.Linear``; also a
    mixture-of-experts router) are the matrices, except any whose path contains ``lm_head``.

    Differences from Levanter: ``lr`` has no effect here either, and saying so is a warning;
    the routed experts of a mixture-of-experts layer get spectral steps, each expert on its own
    (Levanter leaves ``MoELinear`` experts to signum); ``max_grad_norm`` is turned off by null
    (not 0), as in the core's AdamW.
    """

    learning_rate: float = Field(6e-4, ge=0)
    """The matrices' peak learning rate, reached at the end of warmup: the spectral norm of
    the (unscaled) step. Levanter's default is kept; the paper uses learning rates of order
    0.01 to 0.1 for hidden layers."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay, scaled by the learning rate of the part it is in, on the
    parameters ``weight_decay_modules`` / ``default_weight_decay_mask`` select. 0 turns it off."""
    lr: float = 0.02
    """No effect (as in Levanter, where it is left over): ``learning_rate`` is Scion's learning
    rate. Setting it gives a warning."""
    scion_to_signum_lr: float = Field(0.25, ge=0)
    """The learning rate of the sign steps (embeddings, LM head, norms, biases) is
    ``learning_rate`` times this."""
    momentum: float = Field(0.95, ge=0, lt=1)
    """Decay of the moving average of the matrices' gradients that is orthogonalized,
    ``d <- momentum d + (1 - momentum) g`` (the paper's ``alpha`` is ``1 - momentum``)."""
    backend_steps: int = Field(10, ge=1)
    """Number of Newton-Schulz iterations that orthogonalize each matrix's momentum."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """Decay of the moving average of the other parameters' gradients whose sign is the step."""
    scion_epsilon: float = Field(1e-8, gt=0)
    """Added to each matrix's Frobenius norm before dividing by it, ahead of the Newton-Schulz
    iterations (keeps an all-zero matrix at zero)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the gradients of the sign-step parameters so that their global L2 norm is at most
    this (the matrices' are not clipped: orthogonalization discards their scale). None turns
    clipping off."""

    @model_validator(mode="after")
    def _warn_unused_lr(self):
        if "lr" in self.model_fields_set:
            warnings.warn(
                f"optimizer.lr ({self.lr}) has no effect (as in Levanter): Scion's learning rate is "
                "optimizer.learning_rate (times scion_to_signum_lr for the sign steps)",
                UserWarning,
                stacklevel=2,
            )
        return self

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """Spectral steps on the hidden weight matrices, sign steps on the rest
        (``optax.partition``)."""
        decay_mask = self.build_weight_decay_mask()

        spectral = [scale_by_spectral_lmo(self.momentum, self.backend_steps, self.scion_epsilon)]
        if self.weight_decay > 0:
            spectral.append(optax.add_decayed_weights(self.weight_decay, decay_mask))
        spectral.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps)))

        sign = []
        if self.max_grad_norm is not None:
            sign.append(optax.clip_by_global_norm(self.max_grad_norm))
        sign.append(scale_by_sign_lmo(self.beta1))
        if self.weight_decay > 0:
            sign.append(optax.add_decayed_weights(self.weight_decay, decay_mask))
        signum_peak = self.learning_rate * self.scion_to_signum_lr
        sign.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps, learning_rate=signum_peak)))

        return optax.partition(
            {"scion": optax.chain(*spectral), "signum": optax.chain(*sign)},
            lambda params: label_matrices(params, "scion", "signum"),
        )
