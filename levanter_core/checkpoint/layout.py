"""Where a TensorStore checkpoint's files are and whether it is complete: the ``step-N``
directories, the ``COMMITTED`` marker and ``metadata.json``, finding the newest complete
checkpoint under a path, and preparing a checkpointer's directory (see
:mod:`levanter_core.checkpoint.tensorstore` for the layout)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets

import jax

from levanter_core import fileio
from levanter_core.errors import CheckpointError, DamagedCheckpointError
from levanter_core.fileio import is_local, join

logger = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
METADATA_FILE = "metadata.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# what dead saves and deletions leave behind; removed when a checkpointer starts on the path
_DEBRIS = re.compile(r"^step-\d+\.(tmp|deleting)-[0-9a-f]+$")


def discover_latest(path: str) -> str | None:
    """``path`` itself if it is a complete checkpoint; else the complete ``step-N`` directly
    under it with the highest N; else None. Damaged markers are skipped (and logged)."""
    path = _checkpoint_path(path)
    if _names_one_checkpoint(path):
        return path if _marker_problem(path) is None else None
    for checkpoint, problem in _step_directories(path):
        if problem is None:
            return checkpoint
        logger.warning("skipping %s: %s", checkpoint, problem)
    return None


def read_metadata(checkpoint_path: str) -> dict:
    """The contents of a checkpoint's ``metadata.json``: ``step``, ``temporary``,
    ``timestamp``, ``leaves`` and the run's ``metadata``."""
    file = join(_checkpoint_path(checkpoint_path), METADATA_FILE)
    try:
        return json.loads(fileio.read_bytes(file))
    except FileNotFoundError:
        raise DamagedCheckpointError(f"{checkpoint_path} is not a checkpoint: it has no {METADATA_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DamagedCheckpointError(f"{file} is not valid JSON ({e}): the checkpoint is damaged") from None


def _resolve_checkpoint(path: str) -> str:
    """The complete checkpoint ``path`` names or holds; raises saying why there is none."""
    where = _checkpoint_path(path)
    if _names_one_checkpoint(where):
        problem = _marker_problem(where)
        if problem is not None:
            raise DamagedCheckpointError(f"checkpoint {where} is damaged: {problem}")
        return where
    found = discover_latest(where)
    if found is None:
        raise CheckpointError(
            f"no complete checkpoint at {path}: expected a step-N directory containing {COMMIT_MARKER}, "
            "or a directory holding such step-N directories"
        )
    return found


def _names_one_checkpoint(path: str) -> bool:
    """Whether ``path`` is meant as one checkpoint (a ``step-N`` directory, or any directory
    with a marker or metadata) rather than a directory of them."""
    names = fileio.list_names(path)
    if not names:
        return False
    return bool(_STEP_DIR.match(_basename(path))) or COMMIT_MARKER in names or METADATA_FILE in names


def _step_directories(path: str) -> list[tuple[str, str | None]]:
    """Every ``step-N`` directory under ``path``, newest first, with what is wrong with its
    marker (None when it is a complete checkpoint)."""
    found = []
    for entry in fileio.list_names(path):
        match = _STEP_DIR.match(entry)
        if match and (not is_local(path) or os.path.isdir(join(path, entry))):
            found.append((int(match.group(1)), join(path, entry)))
    return [(checkpoint, _marker_problem(checkpoint)) for _, checkpoint in sorted(found, reverse=True)]


def _parse_marker(checkpoint: str) -> tuple[dict | None, str | None]:
    """The parsed ``COMMITTED`` marker, or None and what is wrong with it."""
    try:
        raw = fileio.read_bytes(join(checkpoint, COMMIT_MARKER))
    except FileNotFoundError:
        return None, f"it has no {COMMIT_MARKER} marker (its save did not finish, or the marker was deleted)"
    try:
        marker = json.loads(raw)
        step, leaves = int(marker["step"]), int(marker["leaves"])
    except (ValueError, TypeError, KeyError):
        return None, f"its {COMMIT_MARKER} marker is corrupt or truncated ({len(raw)} bytes: {raw[:40]!r})"
    match = _STEP_DIR.match(_basename(checkpoint))
    if match and int(match.group(1)) != step:
        return None, f"its {COMMIT_MARKER} marker is for step {step}"
    return {"step": step, "leaves": leaves}, None


def _read_marker(checkpoint: str) -> dict:
    """The parsed ``COMMITTED`` marker; raises :class:`DamagedCheckpointError` saying what is wrong."""
    marker, problem = _parse_marker(checkpoint)
    if problem is not None:
        raise DamagedCheckpointError(f"checkpoint {checkpoint} is damaged: {problem}")
    assert marker is not None  # _parse_marker gives a marker exactly when it finds no problem
    return marker


def _marker_problem(checkpoint: str) -> str | None:
    return _parse_marker(checkpoint)[1]


def _prepare_directory(path: str) -> None:
    """Create ``path``, check that this process can write there (a run must not find out
    after hours of training), and remove what dead saves and deletions left behind."""
    probe = join(path, f".write-test-{jax.process_index()}-{secrets.token_hex(4)}")
    try:
        if is_local(path):
            os.makedirs(path, exist_ok=True)
        fileio.write_text(probe, "ok")
        fs, inner = fileio.filesystem(probe)
        fs.rm_file(inner)
    except Exception as e:  # OSError locally; an object store's client raises its own errors too
        reason = (e.strerror if isinstance(e, OSError) else None) or f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"cannot write checkpoints to {path}: {reason}. "
            "Set trainer.checkpointer.base_path to a writable directory or bucket."
        ) from None
    if jax.process_index() != 0:
        return
    for entry in fileio.list_names(path):
        # on a bucket, a step-N without its marker is what an unfinished save or deletion leaves
        unfinished = not is_local(path) and _STEP_DIR.match(entry) and not _marker_exists(join(path, entry))
        if _DEBRIS.match(entry) or unfinished:
            logger.info("removing %s, left by a save or deletion that did not finish", entry)
            fileio.remove_tree(join(path, entry))


def _checkpoint_path(path: str) -> str:
    """``path`` made absolute (local) or without trailing slashes (a URL); a
    :class:`CheckpointError` if TensorStore cannot reach it."""
    if fileio.kvstore_spec(str(path)) is None:
        raise CheckpointError(
            f"checkpoint path {path!r}: TensorStore cannot write there; use a local directory, an s3:// bucket "
            "(or an S3-compatible store) or a gs:// bucket"
        )
    return fileio.normalize(path)


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if not is_local(path) else os.path.basename(path)


def _marker_exists(checkpoint: str) -> bool:
    try:
        fileio.read_bytes(join(checkpoint, COMMIT_MARKER))
    except FileNotFoundError:
        return False
    return True


def _remove_marker(checkpoint: str) -> None:
    fs, inner = fileio.filesystem(join(checkpoint, COMMIT_MARKER))
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(inner)
