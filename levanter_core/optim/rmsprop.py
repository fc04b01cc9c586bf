"""``type: rmsprop``: RMSProp with a (bias-corrected) momentum, as Levanter's
``RMSPropMomentumConfig``."""

from __future__ import annotations

import optax
from pydantic import Field

from levanter_core.optim.config import OptimizerConfig


class RMSPropConfig(OptimizerConfig):
    """RMSProp with momentum (Levanter's ``RMSPropMomentumConfig``, registered there under the
    same ``type: rmsprop``).

    Each step: clip the gradients' global norm; divide the gradient by the root of the
    bias-corrected running mean of squared gradients plus ``eps``; take the bias-corrected
    running mean of those (the momentum, ``beta1``); add the decoupled weight decay; scale by
    the scheduled learning rate. Unlike Adam, the momentum averages gradients already divided
    by the root mean square, each by the one of its own step.
    """

    beta1: float = Field(0.9, ge=0, lt=1)
    """Decay rate of the momentum, a running mean of the RMS-scaled gradients. 0: no momentum."""
    beta2: float = Field(0.99, ge=0, lt=1)
    """Decay rate of the running mean of squared gradients."""
    eps: float = Field(1e-30, ge=0)
    """Added to the root of the mean of squared gradients before dividing, for numerical
    stability."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip gradients so their global L2 norm is at most this. None turns clipping off."""

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """Clip, scale by RMS, average into the momentum, add decayed weights, scale by the
        scheduled learning rate."""
        parts = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(optax.scale_by_rms(self.beta2, self.eps, eps_in_sqrt=False, bias_correction=True))
        parts.append(optax.ema(self.beta1, debias=True))
        parts += self.decayed_weights()
        parts.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps)))
        return optax.chain(*parts)
