"""The tracker API: where a run's metrics, summary, hyperparameters and artifacts go.

A tracker plugin provides a config class (subclass of :class:`TrackerConfig`,
registered with the ``register_trackers`` hook) whose :meth:`TrackerConfig.init`
returns a :class:`Tracker`. The trainer talks to trackers only through these
five methods; values are plain Python numbers by the time they arrive.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Sequence

import numpy as np

from levanter_core.config.base import TypedConfig


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a tracker learns about the run it is attached to."""

    run_id: str
    """The run id (``trainer.id`` or derived from the config)."""
    run_dir: str
    """``{trainer.log_dir}/{run_id}``: the run's own directory, already created."""
    config: dict
    """The resolved configuration, as plain JSON-able data."""
    resume_step: int | None = None
    """The step this run resumes after (the checkpoint's step), or None for a fresh start."""


@dataclasses.dataclass(frozen=True)
class Histogram:
    """The distribution of many values (a parameter's entries, say), summarized for a
    tracker: ``counts[i]`` values fell in ``[edges[i], edges[i + 1])``."""

    counts: np.ndarray
    edges: np.ndarray
    min: float
    max: float
    num: int
    sum: float
    sum_squares: float

    @classmethod
    def from_values(cls, values, bins: int = 64) -> "Histogram":
        """Summarize ``values`` (any array; non-finite entries are left out of the bins
        but counted in ``num``) in ``bins`` equal bins between their min and max."""
        flat = np.asarray(values, dtype=np.float64).ravel()
        finite = flat[np.isfinite(flat)]
        if finite.size == 0:
            return cls(np.zeros(bins, np.int64), np.linspace(0.0, 1.0, bins + 1), 0.0, 0.0, int(flat.size), 0.0, 0.0)
        counts, edges = np.histogram(finite, bins=bins)
        return cls(
            counts,
            edges,
            float(finite.min()),
            float(finite.max()),
            int(flat.size),
            float(finite.sum()),
            float(np.square(finite).sum()),
        )


class Tracker(abc.ABC):
    """Receives what a run reports. Only :meth:`log` is required."""

    @abc.abstractmethod
    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        """Record ``metrics`` at training step ``step``. Each value is a number (a scalar),
        a ``str`` (text) or a :class:`Histogram`; a tracker that cannot show a kind of
        value skips it."""

    def log_summary(self, metrics: dict[str, Any]) -> None:
        """Record end-of-run values (final loss, throughput...)."""

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        """Record the run's configuration (nested, JSON-able)."""

    def log_artifact(self, path: str, *, name: str | None = None, type: str | None = None) -> None:
        """Attach a file or directory produced by the run."""

    def finish(self) -> None:
        """Flush and close. Called once, also when the run fails."""


class TrackerConfig(TypedConfig, abc.ABC):
    """Base class of tracker configs (each item of ``trainer.tracker``)."""

    @abc.abstractmethod
    def init(self, run: RunInfo) -> Tracker:
        """Create the tracker for ``run``."""


class CompositeTracker(Tracker):
    """Fans every call out to several trackers, in order."""

    def __init__(self, trackers: Sequence[Tracker]):
        self.trackers = list(trackers)

    def log(self, metrics, *, step):
        for t in self.trackers:
            t.log(metrics, step=step)

    def log_summary(self, metrics):
        for t in self.trackers:
            t.log_summary(metrics)

    def log_hyperparameters(self, hparams):
        for t in self.trackers:
            t.log_hyperparameters(hparams)

    def log_artifact(self, path, *, name=None, type=None):
        for t in self.trackers:
            t.log_artifact(path, name=name, type=type)

    def finish(self):
        errors = []
        for t in self.trackers:
            try:
                t.finish()
            except Exception as e:  # one tracker failing to close must not stop the others closing
                errors.append(e)
        if errors:
            raise errors[0]


class NoopTracker(Tracker):
    """Discards everything."""

    def log(self, metrics, *, step):
        pass


class NoopTrackerConfig(TrackerConfig):
    """``type: noop``: record nothing (the run directory still gets its config)."""

    def init(self, run: RunInfo) -> Tracker:
        return NoopTracker()
