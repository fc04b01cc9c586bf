"""What every part of the :class:`~levanter_core.trainer.trainer.Trainer` shares: its settings
(the config, optimizer, objective, mesh, precision policy, axis mappings and batch plans, which
``Trainer.__init__`` sets), the batch axis of a size, and the objective's reference model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jmp
import optax
from haliax import Axis
from jax.sharding import Mesh

from levanter_core import lora
from levanter_core.objective import Objective
from levanter_core.trainer.batch_plan import BatchPlan
from levanter_core.trainer.config import TrainerConfig


class TrainerBase:
    """The settings and shared helpers of a Trainer; its other parts
    (:mod:`~levanter_core.trainer.state_init`, :mod:`~levanter_core.trainer.placement`,
    :mod:`~levanter_core.trainer.step`, :mod:`~levanter_core.trainer.eval_step`) build on it."""

    config: TrainerConfig
    optimizer: optax.GradientTransformation
    objective: Objective
    eval_params: Callable[[Any, Any], Any] | None
    mesh: Mesh
    mp: jmp.Policy
    compute_mapping: dict[str, Any]
    parameter_mapping: dict[str, Any]
    plan: BatchPlan
    plans: dict[int, BatchPlan]
    """One plan per batch size of ``trainer.train_batch_size``'s schedule (the first is ``plan``)."""
    quantization: Any
    """haliax's quantization config of ``trainer.quantization``; None when off."""
    Batch: Axis
    EvalBatch: Axis

    def batch_axis(self, size: int) -> Axis:
        """The batch axis of a global batch of ``size`` sequences (a size of the schedule)."""
        return Axis(self.config.batch_axis, size)

    def reference_of(self, model, stored=None):
        """The reference model the objective compares ``model`` with
        (:attr:`~levanter_core.objective.Objective.keeps_reference`): ``stored`` (a state's
        ``reference``), else, for a model with LoRA adapters, the model without them; None for
        objectives that keep none."""
        if not self.objective.keeps_reference:
            return None
        if stored is not None:
            return stored
        if lora.has_adapters(model):
            return lora.base_model(model)
        raise ValueError(f"the {self.objective.name!r} objective compares with a reference model, but there is none")

    def _with_reference(self, reference) -> dict:
        """The ``reference=`` keyword for the objective's calls (none when it keeps no reference)."""
        if not self.objective.keeps_reference:
            return {}
        return {"reference": self.mp.cast_to_compute(reference)}
