"""``type: adopt``: ADOPT (Taniguchi et al. 2024, "ADOPT: Modified Adam Can Converge with Any
beta2 with the Optimal Rate", https://arxiv.org/abs/2411.02853)."""

from __future__ import annotations

import optax
import optax.contrib
from pydantic import Field

from levanter_core.config.base import accepted_only_as
from levanter_core.optim.config import OptimizerConfig


class AdoptConfig(OptimizerConfig):
    """ADOPT: Adam with the gradient divided by the second moment of the steps before it (not
    including its own) and then averaged into the momentum, which makes it converge for any
    ``beta2``. The first step only records the gradient's square and does not move the
    parameters.

    Each step: clip the gradients' global norm, ``optax.contrib.scale_by_adopt``, add the
    decoupled weight decay, scale by the scheduled learning rate.

    Deviation from Levanter: the ADOPT update is optax's, which follows the paper (the second
    moment starts at the first gradient's square, no bias correction, and each normalized
    gradient is clipped to ``step**0.25`` in size before entering the momentum, the paper's
    guard against early instability). Levanter's own version starts the moments at 0 with
    Adam's bias corrections and does not clip.
    """

    beta1: float = Field(0.9, ge=0, lt=1)
    """Decay rate of the momentum, a running mean of the normalized gradients."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """Decay rate of the running mean of squared gradients."""
    epsilon: float = Field(1e-6, ge=0)
    """Lower bound on the root of the second moment that a gradient is divided by, for numerical
    stability."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip gradients so their global L2 norm is at most this. None turns clipping off."""
    schedule_list: list[str] | None = None
    """Unused in Levanter, where it has no effect; only null is accepted."""

    _no_schedule_list = accepted_only_as(
        None, "schedule_list", why="schedule_list has no effect in Levanter's ADOPT; remove it"
    )

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """Clip, scale by ADOPT, add decayed weights, scale by the scheduled learning rate."""
        parts = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(optax.contrib.scale_by_adopt(self.beta1, self.beta2, self.epsilon))
        parts += self.decayed_weights()
        parts.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps)))
        return optax.chain(*parts)
