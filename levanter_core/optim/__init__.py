"""Optimizers, the learning-rate schedule, skip-step and model averaging.

:class:`OptimizerConfig` is the base of every ``optimizer:`` section;
:class:`AdamConfig` (``type: adam``) is the built-in AdamW; :class:`SkipStepConfig`
is its ``skip_bad_steps`` section. ``trainer.model_averaging`` is an
:class:`EmaModelAveragingConfig` or an :class:`EmaDecaySqrtConfig`.
"""

from levanter_core.optim.adam import AdamConfig
from levanter_core.optim.config import OptimizerConfig, parameter_path
from levanter_core.optim.model_averaging import (
    EmaDecaySqrtConfig,
    EmaModelAveragingConfig,
    ModelAveraging,
    ModelAveragingConfig,
)
from levanter_core.optim.schedule import learning_rate_schedule
from levanter_core.optim.skipstep import SkipStepConfig

__all__ = [
    "AdamConfig",
    "EmaDecaySqrtConfig",
    "EmaModelAveragingConfig",
    "ModelAveraging",
    "ModelAveragingConfig",
    "OptimizerConfig",
    "SkipStepConfig",
    "learning_rate_schedule",
    "parameter_path",
]
