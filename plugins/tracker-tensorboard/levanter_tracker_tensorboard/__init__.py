"""TensorBoard for levanter-core: the ``type: tensorboard`` tracker."""

from levanter_tracker_tensorboard.tracker import TensorboardConfig, TensorboardTracker

__all__ = ["TensorboardConfig", "TensorboardTracker"]
