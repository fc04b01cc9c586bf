"""``type: lion``: Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
https://arxiv.org/abs/2302.06675)."""

from __future__ import annotations

import optax
from pydantic import Field

from levanter_core.optim.config import OptimizerConfig


class LionConfig(OptimizerConfig):
    """Lion: the update is the sign of an interpolation between the gradient and its running
    mean, so every coordinate moves by the learning rate (or not at all), weight decay aside.
    These updates are larger than Adam's, so Lion usually wants a learning rate 3-10x smaller
    and a weight decay 3-10x larger.

    Each step: clip the gradients' global norm, ``optax.scale_by_lion``, add the decoupled
    weight decay, scale by the scheduled learning rate.
    """

    beta1: float = Field(0.9, ge=0, le=1)
    """Interpolation weight of the running mean (against the new gradient) in the direction
    whose sign is the update."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """Decay rate of the running mean of gradients that Lion keeps."""
    epsilon: float = Field(1e-8, ge=0)
    """Accepted for compatibility with Levanter's configs, where it is also unused: Lion has no
    epsilon, so this has no effect."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip gradients so their global L2 norm is at most this. None turns clipping off."""

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """Clip, scale by Lion, add decayed weights, scale by the scheduled learning rate."""
        parts = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(optax.scale_by_lion(self.beta1, self.beta2))
        parts += self.decayed_weights()
        parts.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps)))
        return optax.chain(*parts)
