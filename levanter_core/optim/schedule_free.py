"""``type: schedule_free_adamw``: Schedule-Free AdamW (Defazio et al. 2024, "The Road Less
Scheduled", https://arxiv.org/abs/2405.15682)."""

from __future__ import annotations

from typing import Any

import jax
import optax
from optax.contrib import ScheduleFreeState, schedule_free, schedule_free_eval_params
from pydantic import Field, model_validator

from levanter_core.optim.config import OptimizerConfig
from levanter_core.optim.schedule import LrSchedule

PyTree = Any


class ScheduleFreeAdamWConfig(OptimizerConfig):
    """Schedule-Free AdamW: AdamW without a decaying learning rate and without momentum,
    which instead keeps a running average of its iterates.

    It keeps three sequences of parameters. ``z`` takes AdamW steps (the gradient divided
    by the root of its bias-corrected running mean square, plus decoupled weight decay,
    times the learning rate) with no momentum; ``x`` is an average of the ``z`` so far,
    each weighted by ``(largest learning rate so far) ** weight_lr_power``; gradients are
    taken at ``y = (1 - beta1) * z + beta1 * x``. The trainer holds ``y`` as the model; the
    ``x`` it evaluates and exports come from :meth:`params_for_evaluation`. The optimizer
    state holds ``z`` beside Adam's second moment, so it is as large as AdamW's. With
    ``trainer.model_averaging`` on, evaluation uses that average of the trained ``y`` instead
    (there is seldom a reason to combine the two).

    The learning rate warms up and then stays at the peak: ``lr_schedule`` must be
    ``constant`` (its default here), and ``cooldown`` is refused; ``decay``, ``cycles``,
    ``cycle_length`` and ``rewarmup``, which only shape a decay, are refused as well;
    ``min_lr_ratio`` is ignored. Tune the peak learning rate anew: the best one tends to be
    higher than with a decaying schedule.

    Built on ``optax.contrib.schedule_free``. Step ``t`` (from 0) moves ``z`` by the
    schedule's rate at ``t``, as AdamW's step ``t`` does, and weighs the new ``z`` in the
    average by that same rate, as the paper does; optax's ``schedule_free_adamw`` weighs it
    by the rate at ``t + 1``, which differs only during warmup. As in optax (unlike the
    paper's PyTorch code) the weights use the scheduled rate, not the rate times Adam's
    second-moment bias correction.
    """

    beta1: float = Field(0.9, gt=0, lt=1)
    """How far the gradients are taken towards the average ``x`` (``y = (1 - beta1) z + beta1
    x``); it takes the place of momentum. The paper also finds 0.95 and 0.98 to work well."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """Decay rate of the running mean of squared gradients. 0.95, as ``type: adam`` here and
    common for language models; the paper's reference code uses 0.999."""
    epsilon: float = Field(1e-8, ge=0)
    """Added to the root of the second moment before dividing, for numerical stability."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip gradients so their global L2 norm is at most this. None turns clipping off."""
    weight_lr_power: float = Field(2.0, ge=0)
    """Each step's iterate enters the average with weight ``(largest learning rate so far) **
    weight_lr_power``, so that warmup steps count for less. 0 weighs all steps equally."""
    lr_schedule: LrSchedule = "constant"  # type: ignore[assignment]  # a name, made a section by validate_default
    """Must be ``constant``: schedule-free training warms up and then keeps the peak learning
    rate; the running average takes the place of the decay. ``warmup`` is the only schedule
    field it uses: ``decay``, ``cycles``, ``cycle_length``, ``rewarmup`` and ``cooldown`` are
    refused and ``min_lr_ratio`` is ignored."""

    @model_validator(mode="after")
    def _check_no_decay(self):
        if self.lr_schedule.type != "constant":
            raise ValueError(
                f"schedule_free_adamw does not decay the learning rate: lr_schedule must be constant "
                f"(its default), not {self.lr_schedule.type!r}; use type: adam for a decaying schedule"
            )
        if self.cooldown is not None:
            raise ValueError("schedule_free_adamw does not decay the learning rate: remove cooldown")
        shaping = {"decay": self.decay, "cycles": self.cycles, "cycle_length": self.cycle_length}
        given = [name for name, value in shaping.items() if value is not None]
        if self.rewarmup != 0:
            given.append("rewarmup")
        if given:
            raise ValueError(
                f"{', '.join(given)} only shape a decay, and schedule_free_adamw has none: remove "
                f"{'it' if len(given) == 1 else 'them'} (warmup is the only schedule field it uses)"
            )
        return self

    def build(self, num_train_steps: int) -> optax.GradientTransformationExtraArgs:
        """Clip, then schedule-free around AdamW without momentum (RMS scaling, decoupled weight
        decay, the warmup-then-constant learning rate)."""
        schedule = self.lr_scheduler(num_train_steps)
        parts = [optax.scale_by_rms(decay=self.beta2, eps=self.epsilon, eps_in_sqrt=False, bias_correction=True)]
        parts += self.decayed_weights()
        parts.append(optax.scale_by_learning_rate(schedule))
        base = optax.chain(*parts)
        # schedule_free counts its steps from 1 and the base optimizer from 0: shift its clock so
        # that a step's averaging weight uses the rate that made the step.
        averaged = schedule_free(
            base,
            learning_rate=lambda count: schedule(count - 1),
            b1=self.beta1,
            weight_lr_power=self.weight_lr_power,
        )
        if self.max_grad_norm is None:
            return averaged
        return optax.chain(optax.clip_by_global_norm(self.max_grad_norm), averaged)

    def params_for_evaluation(self, params: PyTree, opt_state: PyTree) -> PyTree:
        """The average ``x`` of the iterates, from the trained parameters (``y``) and ``z`` in
        the optimizer state (found by type anywhere in it, so inside the trainer's wrappers)."""
        return schedule_free_eval_params(schedule_free_state(opt_state), params)


def schedule_free_state(opt_state: PyTree) -> ScheduleFreeState:
    """The one ``optax.contrib.ScheduleFreeState`` inside ``opt_state``."""
    found = [
        node
        for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScheduleFreeState))
        if isinstance(node, ScheduleFreeState)
    ]
    if len(found) != 1:
        raise ValueError(f"expected one schedule-free state in the optimizer state, found {len(found)}")
    return found[0]
