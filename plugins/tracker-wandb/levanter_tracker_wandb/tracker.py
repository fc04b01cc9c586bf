"""``type: wandb``: metrics, config, summary and artifacts to Weights & Biases.

The W&B run lives in the levanter run directory (``<run_dir>/wandb/``) and takes the
levanter run id as its own id unless ``id`` is set, so a training run that resumes from a
checkpoint resumes the same W&B run (``resume="allow"``). Offline (``mode: offline`` or
``WANDB_MODE=offline``) everything is written there for ``wandb sync`` to upload later.
A run that fails is finished with a non-zero exit code (:data:`EXIT_CODES`), which W&B shows
as "failed".
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from typing import Any, Literal

import jax
import wandb
import wandb.util
from pydantic import Field, field_validator

from levanter_core.errors import ConfigError
from levanter_core.tracker.base import Histogram, RunInfo, RunStatus, Tracker, TrackerConfig
from levanter_tracker_wandb.code import snapshot
from levanter_tracker_wandb.offline import wait_until_written

logger = logging.getLogger(__name__)

EXIT_CODES: dict[str, int] = {"success": 0, "failed": 1, "interrupted": 130}
"""The exit code the W&B run is finished with, by how the training run ended; W&B shows a
run finished with a non-zero one as failed (130: a Ctrl-C, as the shell reports it)."""

# W&B refuses run ids with these characters (they separate parts of its URLs).
_BAD_ID_CHARS = re.compile(r"[/\\#?%:]")


class WandbConfig(TrackerConfig):
    """Log to Weights & Biases (https://wandb.ai). Needs ``wandb login`` for ``mode: online``;
    ``mode: offline`` needs nothing and writes a run that ``wandb sync`` uploads later."""

    entity: str | None = None
    """The W&B entity (user or team). Unset: your default entity."""
    project: str | None = None
    """The W&B project. Unset: W&B's default (``WANDB_PROJECT``, else ``uncategorized``)."""
    name: str | None = None
    """The run's display name. Unset: W&B makes one up."""
    tags: list[str] = Field(default_factory=list)
    """Tags to add to the run."""
    id: str | None = None
    """The W&B run id. Unset: the levanter run id, so a resumed training run resumes the same W&B run."""
    group: str | None = None
    """Group runs together in the W&B UI (e.g. the runs of a sweep)."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """``online``, ``offline`` (write locally, upload later with ``wandb sync``) or ``disabled``.
    Unset: W&B's own choice (``WANDB_MODE``, ``wandb offline``, else online)."""
    resume: bool | Literal["allow", "must", "never", "auto"] = "allow"
    """W&B's ``resume``: ``allow`` (continue the run with this id if W&B has it, else start it),
    ``must`` (fail unless it exists), ``never`` (fail if it exists), ``auto``, or true/false."""
    save_code: bool | str = True
    """Save the code of the git repository the run was started in: its commit, the files git
    knows about and the uncommitted diff (``diff.patch``). A path: use the git repository of
    that directory instead of the working directory's."""
    save_xla_dumps: bool = False
    """At the end of the run, upload the XLA dump directory named by ``--xla_dump_to`` in
    ``XLA_FLAGS`` as an artifact (for debugging compilation; it can be large)."""

    @field_validator("id")
    @classmethod
    def _valid_wandb_id(cls, value: str | None) -> str | None:
        if value is not None and (not value or _BAD_ID_CHARS.search(value)):
            raise ValueError(f"{value!r} is not a W&B run id: it must be non-empty, without / \\ # ? % :")
        return value

    def init(self, run: RunInfo) -> Tracker:
        return WandbTracker(self, run)


class WandbTracker(Tracker):
    """One W&B run, opened on construction and closed by :meth:`finish`."""

    def __init__(self, config: WandbConfig, run: RunInfo):
        self.config = config
        self.resume_step = run.resume_step
        run_id = config.id or run.run_id
        if _BAD_ID_CHARS.search(run_id):
            raise ConfigError(
                f"trainer.id: {run_id!r} cannot be a W&B run id (no / \\ # ? % :); "
                "set trainer.tracker's wandb `id` to one that can"
            )
        # In a multi-host run only the first process reports (the others would open
        # duplicate runs with the same id); the rest get W&B's no-op run.
        mode = config.mode if jax.process_index() == 0 else "disabled"
        git = self._git_snapshot() if mode != "disabled" else None
        settings: dict[str, Any] = {"save_code": False}  # our own code saving, below
        if git is not None:
            settings.update(git_root=git.root, git_commit=git.commit, git_remote_url=git.remote_url)
        self.run = wandb.init(
            entity=config.entity,
            project=config.project,
            name=config.name,
            tags=list(config.tags) or None,
            id=run_id,
            group=config.group,
            mode=mode,
            dir=run.run_dir,
            resume=config.resume,
            settings=wandb.Settings(**{k: v for k, v in settings.items() if v is not None}),
        )
        if git is not None:
            self._save_code(git, run_id)
        if config.save_xla_dumps and _xla_dump_dir() is None:
            logger.warning(
                "wandb save_xla_dumps is set but XLA_FLAGS has no --xla_dump_to=DIR; nothing will be uploaded"
            )

    def _git_snapshot(self):
        if self.config.save_code is False:
            return None
        return snapshot(os.getcwd() if self.config.save_code is True else self.config.save_code)

    def _save_code(self, git, run_id: str) -> None:
        """The repository's files as a ``code`` artifact (W&B's Code tab) and the
        uncommitted changes as ``diff.patch`` among the run's files."""
        listed = set(git.files)
        self.run.log_code(
            git.root,
            name=f"source-{run_id}",
            include_fn=lambda path, root: os.path.relpath(path, root) in listed,
            exclude_fn=lambda path, root: False,
        )
        if git.diff:
            patch = os.path.join(self.run.dir, "diff.patch")
            with open(patch, "w", encoding="utf-8") as f:
                f.write(git.diff)
            self.run.save(patch, base_path=self.run.dir, policy="now")

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        if self.resume_step is not None and step <= self.resume_step:
            return  # the interrupted run logged this step already, and W&B steps only go forward
        row = {name: converted for name, value in metrics.items() if (converted := _to_wandb(value)) is not None}
        if row:
            self.run.log(row, step=int(step))

    def log_summary(self, metrics: dict[str, Any]) -> None:
        self.run.summary.update({k: _plain(v) for k, v in metrics.items()})

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        # A resumed run sends the config again; values that changed (a longer schedule,
        # say) replace the old ones rather than fail.
        self.run.config.update(hparams, allow_val_change=True)

    def log_artifact(self, path: str, *, name: str | None = None, type: str | None = None) -> None:
        artifact = wandb.Artifact(
            _artifact_name(name or os.path.basename(path.rstrip(os.sep))), type=type or "artifact"
        )
        if os.path.isdir(path):
            artifact.add_dir(path)
        else:
            artifact.add_file(path)
        self.run.log_artifact(artifact)

    def finish(self, status: RunStatus = "success") -> None:
        if self.config.save_xla_dumps:
            dump_dir = _xla_dump_dir()
            if dump_dir is not None and os.path.isdir(dump_dir):
                self.log_artifact(dump_dir, name=f"xla_dumps-{self.run.id}", type="xla_dumps")
        # W&B marks a run finished with a non-zero exit code as failed.
        self.run.finish(exit_code=EXIT_CODES[status])
        # So that the run is whole on disk (for `wandb sync`, or a second start that resumes it)
        # when the training run's `finish` returns.
        if not self.run.disabled and not wait_until_written(self.run.settings.sync_file):
            logger.warning("W&B had not finished writing %s after 60 s", self.run.settings.sync_file)


def _xla_dump_dir() -> str | None:
    """The directory of ``--xla_dump_to=DIR`` (or ``--xla_dump_to DIR``) in ``XLA_FLAGS``."""
    args = shlex.split(os.environ.get("XLA_FLAGS", ""))
    for i, arg in enumerate(args):
        if arg.startswith("--xla_dump_to="):
            return arg.split("=", 1)[1]
        if arg == "--xla_dump_to" and i + 1 < len(args):
            return args[i + 1]
    return None


def _artifact_name(name: str) -> str:
    return wandb.util.make_artifact_name_safe(name)


def _plain(value: Any) -> Any:
    """numpy / JAX scalars as Python numbers; anything else unchanged."""
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 else value


def _to_wandb(value: Any) -> Any:
    """A tracker value as W&B shows it: numbers as they are, markup as HTML, other text as
    a one-row table (W&B charts only numbers), histograms with their own bins. None for a
    value W&B cannot show."""
    if isinstance(value, Histogram):
        return wandb.Histogram(np_histogram=(value.counts.tolist(), value.edges.tolist()))
    if isinstance(value, str):
        if value.lstrip().startswith("<"):
            return wandb.Html(value)
        return wandb.Table(columns=["text"], data=[[value]])
    value = _plain(value)
    if isinstance(value, (bool, int, float)):
        return value
    logger.debug("wandb tracker: skipping a value of type %s", type(value).__name__)
    return None
