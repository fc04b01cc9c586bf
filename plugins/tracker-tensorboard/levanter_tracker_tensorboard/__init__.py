"""TensorBoard for levanter-core: the ``type: tensorboard`` tracker.

The tracker's classes are imported on first access, so that loading the plugin stays cheap."""

__all__ = ["TensorboardConfig", "TensorboardTracker"]


def __getattr__(name: str):
    if name in __all__:
        from levanter_tracker_tensorboard import tracker

        return getattr(tracker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
