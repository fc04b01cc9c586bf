"""``type: adam``: AdamW, the default optimizer."""

from __future__ import annotations

import optax
from pydantic import Field, model_validator

from levanter_core.optim.config import OptimizerConfig
from levanter_core.optim.transforms import (
    POST_CLIP_UPDATE_NORM,
    PRE_CLIP_UPDATE_NORM,
    ClipUpdateNormConfig,
    log_global_norm,
    scan_aware_clip_by_block_rms,
)


class AdamConfig(OptimizerConfig):
    """AdamW: Adam with decoupled weight decay, gradient clipping, and the shared
    learning-rate schedule; optionally with a clipped update (``update_rms_clipping`` or
    ``clip_update_norm``) and AdamC's weight decay.

    Each step: clip the gradients' global norm, scale by Adam, add the weight decay, clip the
    update, scale by the learning rate. Both update clippers log the update's global norm
    before and after clipping (``optim/pre_clip_update_norm``, ``optim/post_clip_update_norm``).
    """

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
    update_rms_clipping: float | None = Field(None, gt=0)
    """Clip each parameter's update (Adam's ``m / sqrt(v)`` plus weight decay, before the
    learning rate) so that its root mean square is at most this, as Adafactor and StableAdamW
    do (StableAdamW clips ``g / sqrt(v)`` instead). In a stack of layers each layer is clipped
    on its own. 1.0 is a common choice; None turns it off. Cannot be combined with
    ``clip_update_norm``."""
    clip_update_norm: ClipUpdateNormConfig | None = None
    """Clip the update's global norm to the mean plus ``sigma_factor`` standard deviations of
    the norms of recent updates: a section ``{rolling_interval_length: 128, sigma_factor: 3.0}``
    (``{}`` for those defaults), or None for no clipping. A gentler guard than
    ``skip_bad_steps``. The window is part of the optimizer state, so it is checkpointed; each
    step logs ``optim/clip_update/did_clip``, ``pre_clip_norm``, ``post_clip_norm`` and
    ``update_norm_threshold``. Cannot be combined with ``update_rms_clipping``."""
    adamc_weight_decay: bool = False
    """AdamC (Defazio 2025, "On the Correct Treatment of Weight Decay in Adam",
    https://arxiv.org/abs/2506.02285): scale the weight decay of each step by that step's
    learning rate over the peak ``learning_rate``, so that ``weight_decay / learning rate``
    stays constant as the schedule decays. False: a constant ``weight_decay``."""

    @model_validator(mode="after")
    def _one_update_clipper(self):
        if self.update_rms_clipping is not None and self.clip_update_norm is not None:
            raise ValueError(
                "update_rms_clipping and clip_update_norm cannot be used together; set one of them to null"
            )
        return self

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """Clip, scale by Adam, add decayed weights, clip the update, scale by the scheduled
        learning rate."""
        schedule = self.lr_scheduler(num_train_steps)
        parts = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(optax.scale_by_adam(self.beta1, self.beta2, self.epsilon, nesterov=self.nesterov))
        parts += self.decayed_weights(schedule if self.adamc_weight_decay else None)
        clipper = None
        if self.update_rms_clipping is not None:
            clipper = scan_aware_clip_by_block_rms(self.update_rms_clipping)
        elif self.clip_update_norm is not None:
            clipper = self.clip_update_norm.build()
        if clipper is not None:
            parts += [log_global_norm(PRE_CLIP_UPDATE_NORM), clipper, log_global_norm(POST_CLIP_UPDATE_NORM)]
        parts.append(optax.scale_by_learning_rate(schedule))
        return optax.chain(*parts)
