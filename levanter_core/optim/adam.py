"""``type: adam``: AdamW, the default optimizer."""

from __future__ import annotations

import optax
from pydantic import Field

from levanter_core.optim.config import OptimizerConfig


class AdamConfig(OptimizerConfig):
    """AdamW: Adam with decoupled weight decay, gradient clipping, and the shared
    learning-rate schedule."""

    beta1: float = Field(0.9, ge=0, lt=1)
    """Decay rate of the running mean of gradients (Adam's first moment)."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """Decay rate of the running mean of squared gradients (Adam's second moment)."""
    epsilon: float = Field(1e-8, ge=0)
    """Added to the root of the second moment before dividing, for numerical stability."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip gradients so their global L2 norm is at most this. None turns clipping off."""
    nesterov: bool = False
    """Use Nesterov momentum (NAdam-style) for the first moment."""

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """Clip, scale by Adam, add decayed weights, scale by the scheduled learning rate."""
        parts = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(optax.scale_by_adam(self.beta1, self.beta2, self.epsilon, nesterov=self.nesterov))
        if self.weight_decay > 0:
            parts.append(optax.add_decayed_weights(self.weight_decay, self.build_weight_decay_mask()))
        parts.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps)))
        return optax.chain(*parts)
