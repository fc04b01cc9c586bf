"""The training state: everything a checkpoint must hold to continue a run exactly."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import equinox as eqx
import jax

from levanter_core.optim.model_averaging import ModelAveraging

M = TypeVar("M")


class TrainerState(eqx.Module, Generic[M]):
    """Step counter, model, optimizer state, the PRNG key for the next step, and the
    averaged model.

    ``step`` counts completed optimizer steps: a state with ``step == N`` has
    trained on batches ``0 .. N-1`` and trains next on batch ``N``. The optimizer
    state holds whatever the optimizer keeps, the skip-step window included.
    """

    step: jax.Array
    model: M
    opt_state: Any
    training_key: jax.Array
    model_averaging: ModelAveraging[M] | None = None
    """The running average of the weights (``trainer.model_averaging``); None when off."""
    reference: M | None = None
    """The model as training started, frozen, for objectives that compare with it
    (:attr:`~levanter_core.objective.Objective.keeps_reference`, preference optimization);
    None otherwise, and for a model with LoRA adapters, whose base is that model. An objective's
    own frozen model (:meth:`~levanter_core.objective.Objective.frozen_model`, a distillation
    teacher) is held here too, but not checkpointed: it is put in after each start."""
