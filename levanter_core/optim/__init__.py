"""Optimizers and the learning-rate schedule.

:class:`OptimizerConfig` is the base of every ``optimizer:`` section;
:class:`AdamConfig` (``type: adam``) is the built-in AdamW.
"""

from levanter_core.optim.adam import AdamConfig
from levanter_core.optim.config import OptimizerConfig, parameter_path
from levanter_core.optim.schedule import learning_rate_schedule

__all__ = ["AdamConfig", "OptimizerConfig", "learning_rate_schedule", "parameter_path"]
