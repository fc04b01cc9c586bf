"""Optimizers, the learning-rate schedule, skip-step and model averaging.

:class:`OptimizerConfig` is the base of every ``optimizer:`` section;
:class:`AdamConfig` (``type: adam``) is the built-in AdamW, with :class:`LionConfig`,
:class:`AdoptConfig`, :class:`RMSPropConfig` and :class:`CautiousConfig` beside it;
:class:`SkipStepConfig` is its ``skip_bad_steps`` section. :mod:`levanter_core.optim.step`
says what an optimizer's ``update`` receives from the trainer (:class:`BatchObjective` among
it). ``trainer.model_averaging`` is an :class:`EmaModelAveragingConfig` or an
:class:`EmaDecaySqrtConfig`.
"""

from levanter_core.optim.adam import AdamConfig
from levanter_core.optim.adopt import AdoptConfig
from levanter_core.optim.cautious import CautiousConfig
from levanter_core.optim.config import OptimizerConfig, parameter_path
from levanter_core.optim.lion import LionConfig
from levanter_core.optim.model_averaging import (
    EmaDecaySqrtConfig,
    EmaModelAveragingConfig,
    ModelAveraging,
    ModelAveragingConfig,
)
from levanter_core.optim.rmsprop import RMSPropConfig
from levanter_core.optim.schedule import learning_rate_schedule
from levanter_core.optim.skipstep import SkipStepConfig
from levanter_core.optim.step import BatchObjective, hessian_vector_product

__all__ = [
    "AdamConfig",
    "AdoptConfig",
    "BatchObjective",
    "CautiousConfig",
    "EmaDecaySqrtConfig",
    "EmaModelAveragingConfig",
    "LionConfig",
    "ModelAveraging",
    "ModelAveragingConfig",
    "OptimizerConfig",
    "RMSPropConfig",
    "SkipStepConfig",
    "hessian_vector_product",
    "learning_rate_schedule",
    "parameter_path",
]
