"""``trainer.model_averaging``: a running average of the weights, kept beside the model.

An average of the weights over recent steps often evaluates better than the
weights of the last step. The averaged model lives in the training state (so it is
checkpointed with everything else) and is updated after every optimizer step;
evaluation uses it instead of the raw model. Two strategies, chosen by ``type``:

* ``ema``: exponential moving average, ``averaged = beta * averaged + (1 - beta) * model``.
* ``ema_decay_sqrt``: the same EMA until ``switch_step``; after it the new model's weight
  falls as ``1 - sqrt(x)`` over ``decay_steps`` steps (``x`` from 0 to 1), never below
  ``epsilon``, so the average settles on the weights of the decay phase.
"""

from __future__ import annotations

import abc
from typing import Annotated, Generic, Literal, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from pydantic import Field

from levanter_core.config.base import ConfigModel

M = TypeVar("M")


class ModelAveraging(eqx.Module, Generic[M]):
    """An averaged model and the rule that folds each new model into it."""

    model: M
    """The averaged model, with the structure, precision and sharding of the trained one."""

    @abc.abstractmethod
    def new_model_weight(self, step: jax.Array) -> jax.Array:
        """The weight of the new model in the average after optimizer step ``step`` (0 for
        the first step); the average keeps ``1 -`` this weight."""

    def update(self, new_model: M, step: jax.Array) -> ModelAveraging[M]:
        """This average with ``new_model`` (the model after optimizer step ``step``) folded
        in. Only floating-point arrays are averaged; other leaves are taken from ``new_model``."""
        weight = self.new_model_weight(step)

        def fold(averaged, new):
            if not eqx.is_inexact_array(new):
                return new
            return ((1 - weight) * averaged + weight * new).astype(averaged.dtype)

        return eqx.tree_at(lambda m: m.model, self, jax.tree.map(fold, self.model, new_model))


class EmaModelAveraging(ModelAveraging[M]):
    """Exponential moving average: the new model always has weight ``1 - beta``."""

    beta: float = eqx.field(static=True)

    def new_model_weight(self, step: jax.Array) -> jax.Array:
        return jnp.asarray(1 - self.beta, jnp.float32)


class EmaDecaySqrtModelAveraging(ModelAveraging[M]):
    """EMA until ``switch_step``; then the new model's weight is
    ``max(1 - sqrt(clip((step - switch_step) / decay_steps, 0, 1)), epsilon)``."""

    beta: float = eqx.field(static=True)
    switch_step: int = eqx.field(static=True)
    decay_steps: int = eqx.field(static=True)
    epsilon: float = eqx.field(static=True)

    def new_model_weight(self, step: jax.Array) -> jax.Array:
        progress = jnp.clip((step - self.switch_step) / self.decay_steps, 0.0, 1.0)
        decaying = jnp.maximum(1 - jnp.sqrt(progress), self.epsilon)
        return jnp.where(step < self.switch_step, 1 - self.beta, decaying).astype(jnp.float32)


class EmaModelAveragingConfig(ConfigModel):
    """``type: ema``: exponential moving average of the weights."""

    type: Literal["ema"] = "ema"
    """The averaging strategy."""
    beta: float = Field(0.999, ge=0, lt=1)
    """After every step, ``averaged = beta * averaged + (1 - beta) * model``. Closer to 1 averages
    over more steps (about ``1 / (1 - beta)``)."""

    def create(self, model: M) -> EmaModelAveraging[M]:
        """An average that starts at ``model``."""
        return EmaModelAveraging(model, beta=self.beta)


class EmaDecaySqrtConfig(ConfigModel):
    """``type: ema_decay_sqrt``: EMA until ``switch_step``, then an average whose weight on each
    new model decays as ``1 - sqrt(x)``, meant for the decay phase of a warmup-stable-decay
    schedule."""

    type: Literal["ema_decay_sqrt"] = "ema_decay_sqrt"
    """The averaging strategy."""
    beta: float = Field(0.999, ge=0, lt=1)
    """Before ``switch_step``: ``averaged = beta * averaged + (1 - beta) * model`` after every step."""
    switch_step: int = Field(100_000, ge=0)
    """The step where the EMA ends and the ``1 - sqrt`` decay begins. At this step the new model
    has weight 1, so the average restarts from it."""
    decay_steps: int = Field(100_000, ge=1)
    """Over how many steps after ``switch_step`` the new model's weight falls from 1 to ``epsilon``:
    ``1 - sqrt((step - switch_step) / decay_steps)``."""
    epsilon: float = Field(1e-5, ge=0, le=1)
    """The smallest weight a new model gets during and after the decay."""

    def create(self, model: M) -> EmaDecaySqrtModelAveraging[M]:
        """An average that starts at ``model``."""
        return EmaDecaySqrtModelAveraging(
            model, beta=self.beta, switch_step=self.switch_step, decay_steps=self.decay_steps, epsilon=self.epsilon
        )


ModelAveragingConfig = Annotated[EmaModelAveragingConfig | EmaDecaySqrtConfig, Field(discriminator="type")]
"""A ``trainer.model_averaging`` section, its class chosen by ``type``."""
