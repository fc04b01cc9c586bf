"""Noticing a run that is an earlier run made longer.

A run id left unset is derived from a hash of the config (:func:`~levanter_core.run.record.
derive_run_id`), so re-running a run with a larger ``trainer.num_train_steps`` names a *new* run,
which starts at step 0. That is right for a changed experiment, but surprising for someone who
meant "train longer": :func:`earlier_runs_made_longer` finds the earlier run, and
:func:`warn_if_restarting` says so, with the command that continues it instead (docs/checkpoints.md,
"Training a run longer").
"""

from __future__ import annotations

import dataclasses
import logging
import re

import yaml

from levanter_core.checkpoint import discover_latest, read_metadata
from levanter_core.fileio import exists, join, list_names, read_bytes

logger = logging.getLogger(__name__)

_IGNORED = (("trainer", "num_train_steps"), ("trainer", "id"), ("trainer", "distributed"))
"""What may differ between a run and the same run made longer (and between its attempts)."""


@dataclasses.dataclass(frozen=True)
class EarlierRun:
    """A run of the same config but for ``trainer.num_train_steps``, with a checkpoint."""

    run_id: str
    num_train_steps: int
    checkpoint: str
    """Its newest complete checkpoint."""
    step: int
    """The step of that checkpoint."""

    @property
    def finished(self) -> bool:
        return self.step >= self.num_train_steps


def earlier_runs_made_longer(config, resolved: dict, run_id: str) -> list[EarlierRun]:
    """The runs in ``trainer.log_dir`` whose id was derived from the same config file name as
    ``run_id`` (``{stem}-{hash}``), whose
    resolved config (their ``config.yaml``) is ``resolved`` but for ``trainer.num_train_steps``,
    and that have a checkpoint, when the run ``run_id`` is about to start afresh: its id derived
    (no ``trainer.id``), no checkpoint of its own yet, and no explicit checkpoint to start from.
    Empty otherwise."""
    trainer = config.trainer
    base_path = getattr(trainer.checkpointer, "base_path", None)
    if trainer.id or trainer.load_checkpoint is False or trainer.load_checkpoint_path or not base_path:
        return []
    if discover_latest(join(base_path, run_id)) is not None:
        return []  # it resumes itself
    stem = re.escape(run_id.rsplit("-", 1)[0])  # a derived id is {config file stem}-{hash}
    wanted = _without_ignored(resolved)
    found = []
    try:
        names = list_names(trainer.log_dir) if exists(trainer.log_dir) else []
    except OSError:
        return []
    for name in sorted(names):
        if name == run_id or not re.fullmatch(rf"{stem}-[0-9a-f]{{8}}", name):
            continue
        try:
            theirs = yaml.safe_load(read_bytes(join(trainer.log_dir, name, "config.yaml")))
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(theirs, dict) or _without_ignored(theirs) != wanted:
            continue
        checkpoint = discover_latest(join(base_path, name))
        if checkpoint is None:
            continue
        steps = (theirs.get("trainer") or {}).get("num_train_steps")
        if not isinstance(steps, int):
            continue  # a config.yaml that does not say how long its run is (edited by hand): not one of ours
        found.append(EarlierRun(name, int(steps), checkpoint, int(read_metadata(checkpoint)["step"])))
    return found


def warn_if_restarting(config, resolved: dict, run_id: str) -> list[EarlierRun]:
    """Log a warning for each run :func:`earlier_runs_made_longer` finds: this run starts over
    at step 0, and ``--trainer.id`` of the earlier one would continue it. Returns them."""
    earlier = earlier_runs_made_longer(config, resolved, run_id)
    steps = config.trainer.num_train_steps
    for run in earlier:
        state = "finished" if run.finished else "stopped"
        logger.warning(
            "run %s is a new run that starts at step 0: run %s has the same config except "
            "trainer.num_train_steps (%d, now %d), and %s with a checkpoint at step %d (%s). A run id "
            "is derived from a hash of the config, so changing num_train_steps names a new run. To train "
            "%s longer instead, stop this one and run the same command with --trainer.id %s (it resumes "
            "from step %d and trains to step %d); see 'Training a run longer' in docs/checkpoints.md.",
            run_id, run.run_id, run.num_train_steps, steps, state, run.step, run.checkpoint,
            run.run_id, run.run_id, run.step, steps,
        )  # fmt: skip
    return earlier


def _without_ignored(resolved: dict) -> dict:
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in resolved.items()}
    for section, key in _IGNORED:
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out
