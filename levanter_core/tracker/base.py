"""The tracker API: where a run's metrics, summary, hyperparameters and artifacts go.

A tracker plugin provides a config class (subclass of :class:`TrackerConfig`,
registered with the ``register_trackers`` hook) whose :meth:`TrackerConfig.init`
returns a :class:`Tracker`. The trainer talks to trackers only through these
five methods; values are plain Python numbers by the time they arrive.

When the run ends, :meth:`Tracker.finish` is told how (:data:`RunStatus`), so a tracker
can mark a failed run as failed. Trackers written before it took that argument
(``def finish(self)``) still work: :func:`finish_tracker` calls them without it.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import warnings
from collections.abc import Sequence
from typing import Any, Literal, get_args

import numpy as np

from levanter_core.config.base import TypedConfig

RunStatus = Literal["success", "failed", "interrupted"]
"""How a run ended, as :meth:`Tracker.finish` is told: ``"success"`` (it trained every
step and saved its last checkpoint), ``"failed"`` (an error stopped it: a bad batch, a NaN
loss under ``trainer.crash_on_nan``, a failed save...) or ``"interrupted"`` (stopped by
the user: Ctrl-C)."""

RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a tracker learns about the run it is attached to."""

    run_id: str
    """The run id (``trainer.id`` or derived from the config)."""
    run_dir: str
    """``{trainer.log_dir}/{run_id}``: the run's own directory, already created."""
    config: dict[str, Any]
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
    def from_values(cls, values: Any, bins: int = 64) -> Histogram:
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

    def finish(self, status: RunStatus = "success") -> None:
        """Flush and close. Called once when the run ends, whether it succeeded or not;
        ``status`` (a :data:`RunStatus`) says how it ended, for trackers that show it
        (a W&B run marked failed, say). An override may leave the argument out
        (``def finish(self)``), as trackers written before it existed do; it then gets
        called without it."""


class TrackerConfig(TypedConfig, abc.ABC):
    """Base class of tracker configs (each item of ``trainer.tracker``)."""

    @abc.abstractmethod
    def init(self, run: RunInfo) -> Tracker:
        """Create the tracker for ``run``."""


class CompositeTracker(Tracker):
    """Fans every call out to several trackers, in order."""

    def __init__(self, trackers: Sequence[Tracker]):
        self.trackers = list(trackers)

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        for t in self.trackers:
            t.log(metrics, step=step)

    def log_summary(self, metrics: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log_summary(metrics)

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log_hyperparameters(hparams)

    def log_artifact(self, path: str, *, name: str | None = None, type: str | None = None) -> None:
        for t in self.trackers:
            t.log_artifact(path, name=name, type=type)

    def finish(self, status: RunStatus = "success") -> None:
        errors: list[Exception] = []
        for t in self.trackers:
            try:
                finish_tracker(t, status)
            except Exception as e:  # one tracker failing to close must not stop the others closing
                errors.append(e)
        if errors:
            raise errors[0]


def finish_tracker(tracker: Tracker, status: RunStatus) -> None:
    """Close ``tracker``, telling it how the run ended (``status``, a :data:`RunStatus`).

    A tracker whose ``finish`` takes no argument (written before :meth:`Tracker.finish`
    took one) is called without it, with a :class:`DeprecationWarning`: it cannot tell a
    failed run from one that succeeded."""
    if status not in RUN_STATUSES:
        raise ValueError(f"finish_tracker: status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
    signature = inspect.signature(tracker.finish)
    for args, kwargs in (((status,), {}), ((), {"status": status})):
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            continue
        tracker.finish(*args, **kwargs)
        return
    cls = type(tracker)
    warnings.warn(
        f"{cls.__module__}.{cls.__qualname__}.finish() takes no argument, so it is not told how the run "
        f'ended; define it as `def finish(self, status="success")` (status: {", ".join(RUN_STATUSES)})',
        DeprecationWarning,
        stacklevel=2,
    )
    tracker.finish()


class NoopTracker(Tracker):
    """Discards everything."""

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        pass


class NoopTrackerConfig(TrackerConfig):
    """``type: noop``: record nothing (the run directory still gets its config)."""

    def init(self, run: RunInfo) -> Tracker:
        return NoopTracker()
