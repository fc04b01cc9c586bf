"""``type: cautious``: Cautious AdamW (Liang et al. 2024, "Cautious Optimizers: Improving
Training with One Line of Code", https://arxiv.org/abs/2411.16085)."""

from __future__ import annotations

import optax
from pydantic import Field

from levanter_core.optim.config import OptimizerConfig
from levanter_core.optim.transforms import cautious


class CautiousConfig(OptimizerConfig):
    """Cautious AdamW: Adam's update, with each coordinate whose sign disagrees with the
    current gradient's set to 0 and the rest scaled up by ``1 / (mean(mask) + epsilon)``, the
    mean over each whole parameter.

    Each step: clip the gradients' global norm, scale by Adam (bias-corrected), apply the
    cautious mask, add the decoupled weight decay (AdamC's with ``adamc_weight_decay``), scale
    by the scheduled learning rate.
    """

    beta1: float = Field(0.95, ge=0, lt=1)
    """Decay rate of the running mean of gradients (Adam's first moment)."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """Decay rate of the running mean of squared gradients (Adam's second moment)."""
    gamma: float = 0.025
    """Accepted for compatibility with Levanter's configs, where it is also unused: it has no
    effect."""
    epsilon: float = Field(1e-8, ge=0)
    """Added to the root of the second moment before dividing, and to the mask's mean before
    rescaling by it, for numerical stability."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip gradients so their global L2 norm is at most this. None turns clipping off."""
    adamc_weight_decay: bool = False
    """AdamC (Defazio 2025, "On the Correct Treatment of Weight Decay in Adam",
    https://arxiv.org/abs/2506.02285): scale the weight decay of each step by that step's
    learning rate over the peak ``learning_rate``, so that ``weight_decay / learning rate``
    stays constant as the schedule decays. False: a constant ``weight_decay``."""

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """Clip, scale by cautious Adam, add decayed weights, scale by the scheduled learning
        rate."""
        schedule = self.lr_scheduler(num_train_steps)
        parts = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(cautious(optax.scale_by_adam(self.beta1, self.beta2, self.epsilon), self.epsilon))
        parts += self.decayed_weights(schedule if self.adamc_weight_decay else None)
        parts.append(optax.scale_by_learning_rate(schedule))
        return optax.chain(*parts)
