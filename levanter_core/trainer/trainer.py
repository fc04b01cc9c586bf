"""The Trainer: a jit-compiled training step, evaluation, and the loop around them.

One step takes the global batch, splits it into microbatches when
``per_device_parallelism`` asks for fewer sequences per device than the batch
holds (gradient accumulation), computes the loss in the compute precision of
``trainer.mp``, applies the optimizer (which receives the loss too, for
``optimizer.skip_bad_steps``) and folds the new weights into the averaged model
when ``trainer.model_averaging`` is on. The state is donated to the step, so
its buffers are reused in place. Metrics of step N are fetched from the device
only after step N+1 has been dispatched, so the host never stalls the device.

This module is the public face, and :class:`Trainer` its constructor: its parts are one job a
module. :mod:`~levanter_core.trainer.base` the settings every part shares;
:mod:`~levanter_core.trainer.state_init` the state and its initialization;
:mod:`~levanter_core.trainer.placement` a host batch laid out on the mesh;
:mod:`~levanter_core.trainer.step` the compiled training step;
:mod:`~levanter_core.trainer.eval_step` the compiled evaluation;
:mod:`~levanter_core.trainer.batch_plan` how a batch is cut into microbatches;
:mod:`~levanter_core.trainer.sharding_checks` the checks that the axis mappings fit the model;
:mod:`~levanter_core.trainer.trainable` what the optimizer trains; and, for the loop around the
steps, :mod:`~levanter_core.trainer.prefetch` and :mod:`~levanter_core.trainer.throughput`.
Every name imported from ``levanter_core.trainer.trainer`` is here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import haliax as hax
import jax
import jmp
import optax
from haliax import Axis
from jax.sharding import Mesh

from levanter_core.errors import LevanterError
from levanter_core.objective import LmObjective, Objective
from levanter_core.trainer.batch_plan import BatchPlan
from levanter_core.trainer.config import TrainerConfig
from levanter_core.trainer.eval_step import EvalStep
from levanter_core.trainer.mesh import data_axis_size
from levanter_core.trainer.prefetch import Prefetcher
from levanter_core.trainer.sharding_checks import ACTIVATION_AXES
from levanter_core.trainer.state_init import StateInit
from levanter_core.trainer.step import TrainStep
from levanter_core.trainer.throughput import Throughput
from levanter_core.trainer.trainable import trainable

__all__ = [
    "ACTIVATION_AXES",
    "BatchPlan",
    "LossFn",
    "NonFiniteLossError",
    "Prefetcher",
    "Throughput",
    "Trainer",
    "trainable",
]

LossFn = Callable[..., tuple[jax.Array, dict]]
"""``loss_fn(model, example, *, key) -> (scalar, metrics)``: the mean loss of a batch (an
:class:`~levanter_core.models.lm.LmExample`) and any scalars the model wants logged (see
``levanter_core.models.lm.lm_loss_and_metrics``); given to :class:`Trainer` in place of an
objective, it trains next-token prediction with that loss."""


class NonFiniteLossError(LevanterError):
    """The loss became NaN or infinite and ``crash_on_nan``/``crash_on_inf`` asked to stop."""

    exit_code = 1


class Trainer(StateInit, TrainStep, EvalStep):
    """Owns the compiled train and eval steps for one model/optimizer/mesh."""

    def __init__(
        self,
        config: TrainerConfig,
        optimizer: optax.GradientTransformation,
        objective: Objective | LossFn | None = None,
        *,
        mesh: Mesh,
        eval_loss_fn: Callable[..., jax.Array] | None = None,
        loss_fn: LossFn | None = None,
        eval_params: Callable[[Any, Any], Any] | None = None,
    ):
        """``objective`` (:mod:`levanter_core.objective`) says what a batch holds, what the
        step minimizes and what evaluation sums; a loss function in its place trains
        next-token prediction with it (``eval_loss_fn(model, example, *, key) -> scalar`` is
        then what evaluation reports, by default the loss function's first value).

        ``optimizer.update`` is called with the step's loss as the keyword argument ``loss``
        when it accepts extra arguments (``optax.GradientTransformationExtraArgs``, as
        ``OptimizerConfig.build_for_trainer`` makes); a plain optax optimizer works too.

        ``optimizer.update`` also receives ``objective``, ``key`` and ``step``, as
        :mod:`levanter_core.optim.step` describes.

        ``eval_params(params, opt_state) -> params``: the parameters to evaluate and export when
        they are not the trained ones (``OptimizerConfig.params_for_evaluation``; schedule-free
        optimizers evaluate an average of their iterates); None: the trained ones.

        ``loss_fn=``: the keyword this argument had before objectives existed (deprecated)."""
        self.config = config
        self.optimizer = optimizer
        self.eval_params = eval_params
        if loss_fn is not None:
            warnings.warn(
                "Trainer(loss_fn=...) is deprecated: pass the loss function (or an objective) as the third argument",
                DeprecationWarning,
                stacklevel=2,
            )
            if objective is not None:
                raise TypeError("give an objective or loss_fn, not both")
            objective = loss_fn
        if objective is None:
            raise TypeError("Trainer needs an objective (or a loss function)")
        if not isinstance(objective, Objective):
            objective = LmObjective(loss_fn=objective, eval_loss_fn=eval_loss_fn)
        self.objective = objective
        self.mesh = mesh
        self.mp = jmp.get_policy(config.mp)
        self.compute_mapping = config.compute_axis_mapping()
        self.parameter_mapping = config.parameter_axis_mapping()
        self.plan = BatchPlan.from_config(config, data_axis_size(mesh))
        # one plan per batch size of trainer.train_batch_size's schedule (the first is `plan`)
        data_size = data_axis_size(mesh)
        self.plans = {size: BatchPlan.from_config(config, data_size, size) for size in config.batch_schedule.sizes}
        self.plans[self.plan.batch_size] = self.plan
        quantization = config.quantization
        self.quantization = quantization.to_haliax() if quantization is not None and quantization.enabled else None
        self.Batch = Axis(config.batch_axis, self.plan.batch_size)
        self.EvalBatch = Axis(config.batch_axis, self.plan.eval_batch_size)
        self._flat_steps = []  # (state structure, compiled step)
        self._eval_step = hax.named_jit(self._eval_loss, axis_resources=self.compute_mapping)
        self._eval_steps = {}
        self._totals_step = None
        self._local_rows = {}

    def check_finite(self, loss: float, step: int) -> None:
        if math.isnan(loss) and self.config.crash_on_nan:
            raise NonFiniteLossError(f"the training loss became NaN at step {step} (trainer.crash_on_nan is true)")
        if math.isinf(loss) and self.config.crash_on_inf:
            raise NonFiniteLossError(f"the training loss became infinite at step {step} (trainer.crash_on_inf is true)")
