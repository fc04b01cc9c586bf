"""Trackers: the tracker API and the built-in ``json`` and ``noop`` trackers."""

from levanter_core.tracker.base import (
    CompositeTracker,
    Histogram,
    NoopTracker,
    NoopTrackerConfig,
    RunInfo,
    RunStatus,
    Tracker,
    TrackerConfig,
    finish_tracker,
)
from levanter_core.tracker.jit_log import jit_log

__all__ = [
    "CompositeTracker",
    "Histogram",
    "NoopTracker",
    "NoopTrackerConfig",
    "RunInfo",
    "RunStatus",
    "Tracker",
    "TrackerConfig",
    "finish_tracker",
    "jit_log",
]
