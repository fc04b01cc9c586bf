"""The training state: everything a checkpoint must hold to continue a run exactly."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import equinox as eqx
import jax

M = TypeVar("M")


class TrainerState(eqx.Module, Generic[M]):
    """Step counter, model, optimizer state and the PRNG key for the next step.

    ``step`` counts completed optimizer steps: a state with ``step == N`` has
    trained on batches ``0 .. N-1`` and trains next on batch ``N``.
    """

    step: jax.Array
    model: M
    opt_state: Any
    training_key: jax.Array
