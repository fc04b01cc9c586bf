"""The checkpointer's base class and save policy: the ``trainer.checkpointer`` section every
checkpointer's config extends (:class:`CheckpointerConfig`, with ``keep``'s
:class:`CheckpointInterval`), and :class:`Checkpointer`, which decides *when* to save.

A checkpointer plugin provides a config class (subclass of
:class:`CheckpointerConfig`, registered with the ``register_checkpointers``
hook) whose :meth:`CheckpointerConfig.create` returns a :class:`Checkpointer`.
The policy that decides *when* to save lives here, in :meth:`Checkpointer.on_step`;
an implementation only says *how*: :meth:`~Checkpointer.save`,
:meth:`~Checkpointer.load`, :meth:`~Checkpointer.latest` and
:meth:`~Checkpointer.delete`.
"""

from __future__ import annotations

import abc
import datetime
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from pydantic import Field, field_validator

from levanter_core import distributed
from levanter_core.config.base import ConfigModel, TypedConfig
from levanter_core.config.types import Duration
from levanter_core.errors import CheckpointError, DamagedCheckpointError
from levanter_core.fileio import is_local, join, require_filesystem

logger = logging.getLogger(__name__)


class CheckpointInterval(ConfigModel):
    """One item of ``trainer.checkpointer.keep``: save a permanent checkpoint every
    ``every`` steps, up to and including step ``until``."""

    every: int = Field(ge=1)
    """Save a permanent checkpoint at every step that is a multiple of this."""
    until: int | None = Field(None, ge=1)
    """The last step this interval applies to; the next interval takes over after it.
    None: forever (only the last interval may leave it unset)."""


class CheckpointerConfig(TypedConfig, abc.ABC):
    """Base class of checkpointer configs (``trainer.checkpointer``)."""

    base_path: str = "checkpoints/"
    """Where checkpoints go: a local directory, or an ``s3://`` or ``gs://`` bucket (committed by
    a marker object written last). Each is a directory ``step-N`` under ``{base_path}/{run_id}``
    (or under ``base_path`` itself, see ``append_run_id_to_base_path``)."""
    # the default is written as a user writes it (and shown so in the config reference);
    # Duration's validator parses it into a timedelta (validate_default)
    save_interval: Duration | None = "15m"  # type: ignore[assignment]
    """Save a temporary checkpoint when this much time (``'30s'``, ``'15m'``, ``'1h'``) has passed
    since the last save. The previous temporary checkpoint is deleted once the next checkpoint
    is complete. None: no time-based checkpoints."""
    keep: list[CheckpointInterval] = Field(default_factory=lambda: [CheckpointInterval(every=10000)])
    """Which steps get a permanent checkpoint, never deleted. Intervals apply in order: a step is
    kept when it is a multiple of ``every`` of the first interval whose ``until`` it has not passed.
    ``[{every: 1000, until: 10000}, {every: 5000}]`` keeps 1000, 2000, ..., 10000, 15000, 20000, ..."""
    append_run_id_to_base_path: bool = True
    """Put this run's checkpoints in ``{base_path}/{run_id}`` rather than in ``base_path``."""
    delete_old_temp_checkpoints: bool = True
    """If the latest checkpoint from a prior attempt at this run is a temporary one, delete it once
    this attempt has saved a checkpoint. False: keep it."""

    _filesystem_installed = field_validator("base_path")(require_filesystem)

    @field_validator("keep")
    @classmethod
    def _intervals_in_order(cls, keep: list[CheckpointInterval]) -> list[CheckpointInterval]:
        for i, interval in enumerate(keep[:-1]):
            if interval.until is None:
                raise ValueError(
                    f"keep[{i}] has no `until`, so keep[{i + 1}] would never apply: "
                    "only the last interval may omit `until`"
                )
            following = keep[i + 1].until
            if following is not None and following <= interval.until:
                raise ValueError(
                    f"keep[{i + 1}].until ({following}) must be after keep[{i}].until ({interval.until}): "
                    "list the intervals in the order they apply"
                )
        return keep

    def expanded_path(self, run_id: str) -> str:
        """The directory this run's checkpoints go to (``~`` expanded)."""
        path = join(self.base_path, run_id) if self.append_run_id_to_base_path else self.base_path
        return os.path.expanduser(path) if is_local(path) else path

    @abc.abstractmethod
    def create(self, run_id: str, *, metadata: dict | None = None) -> Checkpointer:
        """The checkpointer for run ``run_id``. ``metadata`` (JSON-able: the resolved config,
        plugin versions) is stored in every checkpoint it saves."""

    def location_problem(self, path: str) -> str | None:
        """Why this checkpointer cannot save to or load from ``path`` (its ``base_path``, or a
        checkpoint named by ``trainer.load_checkpoint_path`` and the like); None if it can.
        Asked before a run starts, so that it stops at once rather than at its first save.
        A checkpointer plugin overrides it where some locations are out of its reach."""
        return None


class Checkpointer(abc.ABC):
    """Saves the training state under :attr:`path` as directories ``step-N``, following
    the save policy, and loads it back.

    There are two kinds of checkpoint. *Permanent* ones are saved at the steps ``keep`` asks
    for (and at the end of training) and never deleted. *Temporary* ones are saved when
    ``save_interval`` has passed since the last save; each is deleted once the next checkpoint,
    of either kind, is complete, so at most one temporary checkpoint exists at a time.
    """

    def __init__(
        self,
        path: str,
        *,
        save_interval: datetime.timedelta | None = datetime.timedelta(minutes=15),
        keep: Sequence[CheckpointInterval] = (CheckpointInterval(every=10000),),
        delete_old_temp_checkpoints: bool = True,
        metadata: dict | None = None,
        now: Callable[[], datetime.datetime] = datetime.datetime.now,
    ):
        """``now`` is the clock the time policy reads (tests pass a fake one). This calls
        :meth:`latest` and :meth:`is_temporary`, so a subclass must be able to answer them
        before it calls ``super().__init__``."""
        self.path = path
        self.save_interval = save_interval
        self.keep = list(keep)
        self.metadata = dict(metadata or {})
        json.dumps(self.metadata)  # fail now, not at the first save hours into the run
        self._now = now
        self._last_save_time = now()
        self._last_save_step: int | None = None
        self._time_decision: tuple[int, bool] | None = None  # (step, whether save_interval had passed)
        # how long the latest save held up training: copying the state, waiting for the save before
        self.last_save_blocked_seconds: float | None = None
        self._last_temporary: str | None = None
        if delete_old_temp_checkpoints:
            self._last_temporary = self._prior_temporary_checkpoint()

    # -- what an implementation provides ---------------------------------------------------
    @abc.abstractmethod
    def save(self, state: Any, step: int, *, temporary: bool, on_commit: Callable[[str], None] | None = None) -> str:
        """Save ``state`` as the checkpoint of ``step`` and return its path. ``on_commit`` is
        called with that path once the checkpoint is complete on disk (which may be after
        this returns: a save may finish in the background, but it must have copied ``state``
        before returning, since the caller goes on to reuse its buffers)."""

    @abc.abstractmethod
    def load(self, template: Any, path: str) -> Any:
        """Load the checkpoint at ``path`` into the structure of ``template``. Raise
        :class:`~levanter_core.errors.DamagedCheckpointError` if it cannot be read, and
        :class:`~levanter_core.errors.CheckpointError` if it does not fit. An implementation
        that supports ``trainer.allow_partial_checkpoint`` also takes the keyword
        ``allow_partial`` (see :meth:`load_state`)."""

    @abc.abstractmethod
    def candidates(self, where: str) -> list[str]:
        """The checkpoints to try when resuming from ``where``, newest first: ``[where]`` if it
        names one checkpoint, else every checkpoint under it, complete-looking or not."""

    @abc.abstractmethod
    def latest(self) -> str | None:
        """The newest complete checkpoint under :attr:`path`, or None."""

    @abc.abstractmethod
    def is_temporary(self, checkpoint_path: str) -> bool:
        """Whether the complete checkpoint at ``checkpoint_path`` was saved as temporary."""

    @abc.abstractmethod
    def mark_permanent(self, checkpoint_path: str) -> None:
        """Record that the temporary checkpoint at ``checkpoint_path`` is now permanent."""

    @abc.abstractmethod
    def delete(self, checkpoint_path: str) -> None:
        """Delete the checkpoint at ``checkpoint_path``."""

    def load_state(self, template: Any, path: str, *, allow_partial: bool = False) -> Any:
        """:meth:`load`, passing ``allow_partial=True`` only when asked: a checkpointer whose
        ``load`` was written before that option existed keeps working for whole loads. With
        it, what the checkpoint lacks keeps ``template``'s values."""
        # `load` as implemented: one that supports partial loads takes `allow_partial` (see load)
        load: Callable[..., Any] = self.load
        return load(template, path, allow_partial=True) if allow_partial else load(template, path)

    def set_aside(self, checkpoint_path: str) -> str | None:
        """Move a damaged checkpoint out of the way, keeping its files; return where it went
        (None: left in place)."""
        return None

    def check_for_errors(self) -> None:
        """Raise the error of a background save that failed, if any."""

    def wait_until_finished(self) -> None:
        """Block until every save started so far is complete (and its ``on_commit`` has run);
        raise a failed save's error. Nothing to wait for in a checkpointer whose :meth:`save`
        finishes before returning."""

    # -- resuming ----------------------------------------------------------------------------
    def resume(self, template: Any, where: str | None = None, *, allow_partial: bool = False) -> tuple[Any, str] | None:
        """Load the newest checkpoint under ``where`` (default: :attr:`path`) that loads, and
        return it with its path; None when there is none at all.

        Damaged checkpoints are skipped, each reported; when the search is in this run's own
        directory they are also set aside, so that the run's next save of that step is not
        mistaken for them. If checkpoints exist and none loads, this raises: a run must never
        start again from step 0 over them. ``allow_partial``: ``trainer.allow_partial_checkpoint``
        (passed to :meth:`load`, whose ``template`` then holds the values to keep)."""
        where = where or self.path
        damaged: list[tuple[str, DamagedCheckpointError]] = []
        for candidate in self.candidates(where):
            try:
                state, error = self.load_state(template, candidate, allow_partial=allow_partial), None
            except DamagedCheckpointError as e:
                state, error = None, e
            # Each process reads its own part: all must have succeeded for the state to be whole.
            if not _all_processes_agree(error is None):
                damaged.append((candidate, error or DamagedCheckpointError("another process could not read its part")))
                continue
            for path, problem in damaged:
                aside = self.set_aside(path) if where == self.path else None
                if self._last_temporary == path:
                    self._last_temporary = None  # gone: nothing to delete after the next save
                where_now = f"; moved to {aside}" if aside else ""
                logger.warning("skipped damaged checkpoint %s: %s", path, _reason(path, problem))
                print(f"skipped damaged checkpoint {path}{where_now}:\n  {_reason(path, problem)}", flush=True)
            if damaged:
                print(f"resuming from {candidate}, the newest checkpoint that loads", flush=True)
            if where == self.path and getattr(state, "step", None) is not None:
                # The run's own checkpoint of this step is its last save: a run resumed complete does
                # not save its final step again (a temporary one is marked permanent instead).
                self._last_save_step = int(state.step)
            return state, candidate
        if damaged:
            details = "\n".join(f"- {path}: {_reason(path, problem)}" for path, problem in damaged)
            raise CheckpointError(
                f"every checkpoint under {where} is damaged, so the run cannot resume:\n{details}\n"
                "Refusing to start again from step 0 over them. Repair or remove them, or train elsewhere "
                "(trainer.checkpointer.base_path) or from scratch (trainer.load_checkpoint: false)."
            )
        return None

    # -- the policy --------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether the policy asks for a save after ``step`` (not counting the forced one at the
        end of training). The trainer asks first, to log the step's metrics before its
        checkpoint can exist: a run resumed from that checkpoint never trains the step again."""
        step = int(step)
        if step == self._last_save_step or step <= 0:
            return False
        if self.keeps_step(step):
            return True
        if self.save_interval is None:
            return False
        # Decided once per step (the trainer asks, then on_step), and for every process by
        # the clock of process 0: the processes save together.
        if self._time_decision is None or self._time_decision[0] != step:
            elapsed = self._now() - self._last_save_time >= self.save_interval
            self._time_decision = (step, _process_zero_decides(step, elapsed))
        return self._time_decision[1]

    def on_step(self, state: Any, step: int, *, force: bool = False) -> bool:
        """Called after each training step: save ``state`` if the policy asks for it (see
        :meth:`due`), and say whether a save started. ``force`` saves a permanent checkpoint
        whatever the policy says (the end of training). Step 0, the untrained state, is saved
        only when forced. Raises the error of a background save that failed since the last call."""
        self.check_for_errors()
        step = int(step)
        if step == self._last_save_step:
            if force and self._last_temporary is not None:
                self.wait_until_finished()  # its metadata must be on disk to be rewritten
                self.mark_permanent(self._last_temporary)
                self._last_temporary = None
            return False
        if not (force or self.due(step)):
            return False
        permanent = force or self.keeps_step(step)

        superseded = self._last_temporary

        def delete_superseded(committed: str) -> None:
            if superseded is not None and superseded != committed:
                self.delete(superseded)

        jax.block_until_ready(state)  # the step's own compute is not the save's cost
        started = time.perf_counter()
        saved = self.save(state, step, temporary=not permanent, on_commit=delete_superseded)
        self.last_save_blocked_seconds = time.perf_counter() - started
        self._last_temporary = None if permanent else saved
        self._last_save_step = step
        self._last_save_time = self._now()
        return True

    def keeps_step(self, step: int) -> bool:
        """Whether ``keep`` asks for a permanent checkpoint at ``step``."""
        if step <= 0:
            return False
        for interval in self.keep:
            if interval.until is None or step <= interval.until:
                return step % interval.every == 0
        return False

    def _prior_temporary_checkpoint(self) -> str | None:
        latest = self.latest()
        try:
            temporary = latest is not None and self.is_temporary(latest)
        except DamagedCheckpointError:
            return None  # resuming will report it
        if temporary:
            logger.info("the latest checkpoint %s is temporary: it will be deleted after the next save", latest)
            return latest
        return None


def _reason(path: str, error: Exception) -> str:
    """What is wrong with the checkpoint at ``path``, without repeating its path."""
    return str(error).removeprefix(f"checkpoint {path} is damaged: ")


def _process_zero_decides(step: int, due: bool) -> bool:
    """Process 0's ``due`` for ``step`` in every process (``due`` itself in a single-process run)."""
    if jax.process_count() == 1:
        return due
    # One key per step. The processes step together, so all read a key long before process 0
    # removes it, 64 steps later.
    distributed.forget(f"checkpoint_due/{step - 64}")
    return distributed.share(f"checkpoint_due/{step}", "1" if due else "0") == "1"


def _all_processes_agree(ok: bool) -> bool:
    """Whether ``ok`` holds in every process (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))
