"""TensorStore checkpoints: every array of the training state as a zarr array. This module is
the checkpointer (``type: tensorstore``): its config and its class; the format it keeps is
described here, and written, read and found by :mod:`~levanter_core.checkpoint.writing`,
:mod:`~levanter_core.checkpoint.reading` and :mod:`~levanter_core.checkpoint.layout`.

On disk, under the checkpointer's path (``{base_path}/{run_id}``)::

    step-1000/
      metadata.json        step, temporary, timestamp, every leaf's name/shape/dtype and the
                           checksum of each of its chunks, and the run's metadata (resolved
                           config, plugin versions)
      step/                one zarr array per array leaf, named by its path in the state
      model/transformer/blocks/attn/c_attn/weight/
      opt_state/0/mu/transformer/blocks/attn/c_attn/weight/
      training_key/        a typed PRNG key is stored as its raw key data
      COMMITTED            {"step": 1000, "leaves": 42}, written last

A save copies the state to host memory (the only part that holds up training), then a
background thread writes it, every process its own shards. How it commits depends on where:

* A local directory: the arrays go into ``step-N.tmp-<token>/``; once every process has
  finished writing, process 0 adds ``metadata.json`` and ``COMMITTED`` (each written to a
  temporary name and renamed) and renames the directory to ``step-N``. Whenever a run dies,
  ``step-N`` is either absent or complete; what a dead save leaves behind is a ``.tmp-``
  directory, which discovery ignores and the next checkpointer on the same path removes.
* An object store (``s3://``, ``gs://``), which cannot rename a directory: the arrays go
  straight into ``step-N/``, and ``COMMITTED`` is written last, in one put, after
  ``metadata.json``. A ``step-N/`` without the marker is an unfinished save (or deletion,
  which removes the marker first): discovery ignores it, the next checkpointer on the path
  removes it, and a new save of step N clears it before writing.

A ``step-N`` directory whose marker is missing or unreadable, or whose arrays cannot be read in
full, is *damaged*: resuming skips it for the newest checkpoint that loads, and moves it aside
as ``step-N.damaged-<token>`` so that nothing is lost and a new save of step N is not refused.

On an object store, setting a damaged checkpoint aside copies it (the store has no rename).

zstd chunks carry no checksum of their own, so a bit flipped on the disk or in the store would
decompress into a different weight without a word. Every chunk's checksum (XXH3-64, the fast
non-cryptographic hash of zstd's author) is therefore computed at save, from the bytes in host
memory, and recorded in ``metadata.json`` (``leaves[i]["xxh3_64"]``: chunk key -> hex digest,
keys as zarr names the chunk files: ``"0.1"``); loading reads whole chunks and checks each one
before it reaches a device. A mismatch makes the checkpoint damaged, naming
the array and the chunk. Checkpoints saved before checksums were recorded load unverified.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Callable
from typing import Any

import jax

from levanter_core import fileio
from levanter_core.checkpoint.base import Checkpointer, CheckpointerConfig
from levanter_core.checkpoint.chunks import (
    _MAX_CHUNK_BYTES,
    CHECKSUM,
    _box,
    _checksum,
    _chunk_shape,
    _chunks_in,
    _zarr_spec,
)
from levanter_core.checkpoint.layout import (
    _DEBRIS,
    _STEP_DIR,
    COMMIT_MARKER,
    METADATA_FILE,
    _basename,
    _checkpoint_path,
    _marker_exists,
    _marker_problem,
    _names_one_checkpoint,
    _parse_marker,
    _prepare_directory,
    _read_marker,
    _remove_marker,
    _resolve_checkpoint,
    _step_directories,
    discover_latest,
    read_metadata,
)
from levanter_core.checkpoint.leaves import (
    _UNSAFE_CHARS,
    _describe,
    _flatten,
    _is_key,
    _leaf_name,
    _stored_form,
    _unwrap,
)
from levanter_core.checkpoint.reading import (
    _TENSORSTORE_STATUS,
    _check_fits,
    _ChecksumMismatch,
    _load_tree,
    _read_arrays,
    _read_verified,
    _tensorstore_message,
    load_checkpoint,
)
from levanter_core.checkpoint.writing import (
    _agreed_token,
    _copy_to_host,
    _HostArray,
    _move_into_place,
    _Save,
    _shard_checksums,
    _write_arrays,
    write_checkpoint,
)
from levanter_core.errors import CheckpointError
from levanter_core.fileio import is_local, join, kvstore_spec

logger = logging.getLogger(__name__)

# The names this module held before it was split (some are imported from here still). Constants
# are copies: the code reads them in their own modules (patch ``chunks._MAX_CHUNK_BYTES``).
__all__ = [
    "CHECKSUM",
    "COMMIT_MARKER",
    "METADATA_FILE",
    "_DEBRIS",
    "_MAX_CHUNK_BYTES",
    "_STEP_DIR",
    "_TENSORSTORE_STATUS",
    "_UNSAFE_CHARS",
    "TensorStoreCheckpointer",
    "TensorStoreCheckpointerConfig",
    "_ChecksumMismatch",
    "_HostArray",
    "_Save",
    "_agreed_token",
    "_basename",
    "_box",
    "_check_fits",
    "_checkpoint_path",
    "_checksum",
    "_chunk_shape",
    "_chunks_in",
    "_copy_to_host",
    "_describe",
    "_flatten",
    "_is_key",
    "_leaf_name",
    "_load_tree",
    "_marker_exists",
    "_marker_problem",
    "_move_into_place",
    "_names_one_checkpoint",
    "_parse_marker",
    "_prepare_directory",
    "_read_arrays",
    "_read_marker",
    "_read_verified",
    "_remove_marker",
    "_resolve_checkpoint",
    "_shard_checksums",
    "_step_directories",
    "_stored_form",
    "_tensorstore_message",
    "_unwrap",
    "_write_arrays",
    "_zarr_spec",
    "discover_latest",
    "load_checkpoint",
    "read_metadata",
    "write_checkpoint",
]


class TensorStoreCheckpointerConfig(CheckpointerConfig):
    """``type: tensorstore``: every array of the training state as a zarr array, via TensorStore."""

    def location_problem(self, path: str) -> str | None:
        if kvstore_spec(str(path)) is None:
            return (
                f"{path!r}: TensorStore cannot write there; checkpoints go to a local (or mounted) directory, "
                "an s3:// bucket (or an S3-compatible store) or a gs:// bucket"
            )
        return None

    def create(self, run_id: str, *, metadata: dict | None = None) -> Checkpointer:
        return TensorStoreCheckpointer(
            self.expanded_path(run_id),
            save_interval=self.save_interval,
            keep=self.keep,
            delete_old_temp_checkpoints=self.delete_old_temp_checkpoints,
            metadata=metadata,
        )


class TensorStoreCheckpointer(Checkpointer):
    """Saves and loads the training state with TensorStore (see the module docstring for the
    layout). :meth:`save` returns once the state is copied to host memory; the writing goes on
    in a background thread, one save at a time. A save that fails is raised by the next call
    to :meth:`save`, :meth:`on_step` or :meth:`wait_until_finished`."""

    def __init__(self, path: str, **policy: Any):
        """Takes :class:`Checkpointer`'s arguments; ``path`` is a local directory or an
        object-store URL, which is created, checked to be writable, and cleared of what dead
        saves left behind."""
        path = _checkpoint_path(path)
        _prepare_directory(path)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        super().__init__(path, **policy)

    def save(self, state: Any, step: int, *, temporary: bool, on_commit: Callable[[str], None] | None = None) -> str:
        self.wait_until_finished()
        final = join(self.path, f"step-{int(step)}")
        job = _Save(state, final, step=int(step), temporary=temporary, metadata=self.metadata)

        def write() -> None:
            try:
                job.write()
                logger.info("saved %s checkpoint %s", "temporary" if temporary else "permanent", final)
                if on_commit is not None and jax.process_index() == 0:
                    on_commit(final)
            except BaseException as e:  # handed to the training thread, which stops the run
                self._error = e

        # Not a daemon: an interpreter that is shutting down still finishes the save.
        self._thread = threading.Thread(target=write, name=f"levanter-save-step-{step}")
        self._thread.start()
        return final

    def check_for_errors(self) -> None:
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, CheckpointError):
            raise error
        latest = self.latest()
        raise CheckpointError(
            f"saving a checkpoint under {self.path} failed: {type(error).__name__}: {error}\n"
            "The run stops rather than train on without saving. Fix the cause (disk space, permissions) and run "
            "the same command again: it resumes from "
            + (latest if latest else "the start, as no checkpoint was completed")
        ) from error

    def wait_until_finished(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check_for_errors()

    def load(self, template: Any, path: str, *, allow_partial: bool = False) -> Any:
        return load_checkpoint(template, path, allow_partial=allow_partial)

    def candidates(self, where: str) -> list[str]:
        where = _checkpoint_path(where)
        if _names_one_checkpoint(where):
            return [where]
        return [path for path, _ in _step_directories(where)]

    def set_aside(self, checkpoint_path: str) -> str | None:
        if jax.process_index() != 0:
            return None
        aside = f"{checkpoint_path}.damaged-{secrets.token_hex(4)}"
        try:
            fileio.move_tree(checkpoint_path, aside)
        except OSError as e:
            logger.warning("could not move the damaged checkpoint %s aside: %s", checkpoint_path, e)
            return None
        return aside

    def latest(self) -> str | None:
        return discover_latest(self.path)

    def is_temporary(self, checkpoint_path: str) -> bool:
        return bool(read_metadata(checkpoint_path).get("temporary", False))

    def mark_permanent(self, checkpoint_path: str) -> None:
        if jax.process_index() == 0:
            metadata = read_metadata(checkpoint_path)
            metadata["temporary"] = False
            fileio.write_text(join(checkpoint_path, METADATA_FILE), json.dumps(metadata, indent=1))

    def delete(self, checkpoint_path: str) -> None:
        if jax.process_index() != 0:
            return
        logger.info("deleting superseded temporary checkpoint %s", checkpoint_path)
        try:
            if is_local(checkpoint_path):
                # Renamed first, so that a deletion cut short leaves debris, never a damaged step-N.
                doomed = f"{checkpoint_path}.deleting-{secrets.token_hex(4)}"
                os.rename(checkpoint_path, doomed)
                shutil.rmtree(doomed)
            else:
                # The marker first, so that a deletion cut short leaves an unfinished save.
                _remove_marker(checkpoint_path)
                fileio.remove_tree(checkpoint_path)
        except OSError as e:  # housekeeping: failing to delete an old checkpoint must not stop training
            logger.warning("could not delete %s: %s", checkpoint_path, e)
