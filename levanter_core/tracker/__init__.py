"""Trackers: the tracker API and the built-in ``json`` and ``noop`` trackers."""

from levanter_core.tracker.base import CompositeTracker, NoopTracker, NoopTrackerConfig, RunInfo, Tracker, TrackerConfig

__all__ = ["CompositeTracker", "NoopTracker", "NoopTrackerConfig", "RunInfo", "Tracker", "TrackerConfig"]
