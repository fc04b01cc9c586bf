"""TensorStore checkpoints: every array of the training state as a zarr array.

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

import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
import xxhash
from jax.experimental import multihost_utils

from levanter_core import distributed, fileio
from levanter_core.checkpoint.config import Checkpointer
from levanter_core.errors import CheckpointError, DamagedCheckpointError
from levanter_core.fileio import is_local, join

logger = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
METADATA_FILE = "metadata.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# what dead saves and deletions leave behind; removed when a checkpointer starts on the path
_DEBRIS = re.compile(r"^step-\d+\.(tmp|deleting)-[0-9a-f]+$")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.=-]")
# TensorStore reports missing or unreadable data as a ValueError whose message starts with a
# status code ("NOT_FOUND: chunk {0, 0} ... is missing"); other ValueErrors are not about the data.
_TENSORSTORE_STATUS = re.compile(r"^[A-Z_]+: ")
# The checksum recorded for every chunk (see the module docstring); the name is the metadata key.
CHECKSUM = "xxh3_64"
# Arrays are chunked along their shards, and shards further split until a chunk holds at most
# this much, so that writing and reading run in parallel and no two processes share a chunk.
_MAX_CHUNK_BYTES = 64 << 20


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


def write_checkpoint(
    state: Any, final: str, *, step: int, temporary: bool = False, metadata: dict | None = None
) -> str:
    """Write ``state`` (any pytree of arrays) as a committed checkpoint at ``final`` and return
    once it is complete: into a staging directory, then ``metadata.json`` (holding ``metadata``)
    and the ``COMMITTED`` marker, then renamed into place."""
    _Save(state, final, step=int(step), temporary=temporary, metadata=metadata).write()
    return final


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


def load_checkpoint(template: Any, path: str, *, subtree: str | None = None, allow_partial: bool = False) -> Any:
    """Load the checkpoint at ``path`` (a ``step-N`` directory, or a directory of them: the
    latest complete one is used) into the structure of ``template``.

    ``template`` is a pytree like the one saved, whose array leaves are arrays or
    ``jax.ShapeDtypeStruct``\\ s; each loaded array gets its template's sharding (the first
    device of this process when it has none). Leaves that are not arrays are taken from ``template``.
    Raises :class:`CheckpointError`, before reading any data, when names, shapes or dtypes
    differ, and :class:`DamagedCheckpointError` when the marker or the metadata is damaged or
    an array cannot be read in full.

    ``subtree`` loads one part of what was saved: ``subtree="model"`` loads a model
    (``template``) from a checkpoint of a whole training state, or of a model alone.

    ``allow_partial`` (``trainer.allow_partial_checkpoint``): leaves the checkpoint lacks keep
    ``template``'s values (which must then be arrays, not shapes), each named in a warning.
    """
    checkpoint = _resolve_checkpoint(path)
    described = read_metadata(checkpoint)
    marker = _read_marker(checkpoint)
    if marker["leaves"] != len(described["leaves"]):
        raise DamagedCheckpointError(
            f"checkpoint {checkpoint} is damaged: its marker counts {marker['leaves']} arrays, "
            f"its {METADATA_FILE} lists {len(described['leaves'])}"
        )
    stored = {leaf["name"]: leaf for leaf in described["leaves"]}
    if subtree is not None:
        stored = {name: leaf for name, leaf in stored.items() if name.startswith(subtree + "/")}
        return _load_tree({subtree: template}, checkpoint, stored, allow_partial)[subtree]
    return _load_tree(template, checkpoint, stored, allow_partial)


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


def _load_tree(template: Any, checkpoint: str, stored: dict[str, dict], allow_partial: bool = False) -> Any:
    """Load the leaves ``stored`` (name -> description) of ``checkpoint`` into ``template``."""
    leaves, treedef, names = _flatten(template)
    expected = {name: _describe(name, _unwrap(leaves[i])) for name, i in names.items()}
    if allow_partial:
        missing = sorted(expected.keys() - stored.keys())
        shapes_only = [name for name in missing if isinstance(_unwrap(leaves[names[name]]), jax.ShapeDtypeStruct)]
        if shapes_only:
            raise CheckpointError(
                f"checkpoint {checkpoint} lacks {shapes_only[0]}, and there is no value to keep for it"
            )
        for name in missing:
            logger.warning(
                "checkpoint %s has no %s: it keeps its fresh value (allow_partial_checkpoint)", checkpoint, name
            )
        if missing:
            print(
                f"loading {checkpoint} partially: {len(missing)} of {len(expected)} arrays are not in it and "
                f"start fresh ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})",
                flush=True,
            )
        names = {name: i for name, i in names.items() if name in stored}
        expected = {name: expected[name] for name in names}
    _check_fits(checkpoint, expected, stored)
    arrays = _read_arrays(checkpoint, {name: (_unwrap(leaves[i]), stored[name]) for name, i in names.items()})
    for name, i in names.items():
        leaf = leaves[i]
        leaves[i] = dataclasses.replace(leaf, array=arrays[name]) if isinstance(leaf, hax.NamedArray) else arrays[name]
    return jax.tree_util.tree_unflatten(treedef, leaves)


# -- naming the leaves ---------------------------------------------------------------------


def _flatten(tree: Any) -> tuple[list, Any, dict[str, int]]:
    """The leaves of ``tree`` (a NamedArray is one leaf), its structure, and for each leaf
    holding an array, its name -> its index among the leaves."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, hax.NamedArray))
    names: dict[str, int] = {}
    for i, (key_path, leaf) in enumerate(flat):
        if _unwrap(leaf) is None:
            continue
        name = _leaf_name(key_path)
        if name in names or name in (METADATA_FILE, COMMIT_MARKER):
            raise ValueError(
                f"cannot checkpoint this state: two of its leaves, or a leaf and a file, are named {name!r}"
            )
        names[name] = i
    return [leaf for _, leaf in flat], treedef, names


def _leaf_name(key_path: tuple) -> str:
    """``model/transformer/blocks/attn/c_attn/weight``: one path component per pytree key,
    each made safe as a file name."""
    parts = []
    for key in key_path:
        part = _UNSAFE_CHARS.sub("_", jax.tree_util.keystr((key,), simple=True))
        parts.append(part if part and not part.startswith(".") else "_" + part)
    return "/".join(parts) or "value"


def _unwrap(leaf: Any) -> Any:
    """The array (or ShapeDtypeStruct) a leaf holds, or None when it holds none."""
    if isinstance(leaf, hax.NamedArray):
        leaf = leaf.array
    return leaf if isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)) else None


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _describe(name: str, x: Any) -> dict:
    described = {"name": name, "shape": list(x.shape), "dtype": str(x.dtype)}
    if _is_key(x) and not isinstance(x, jax.ShapeDtypeStruct):
        described["key_impl"] = str(jax.random.key_impl(x))
    return described


def _stored_form(x: Any) -> jax.Array:
    """What goes into zarr: typed PRNG keys as their raw key data, NumPy values as jax arrays."""
    if _is_key(x):
        return jax.random.key_data(x)
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


# -- writing ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _HostArray:
    """One array of the state, as this process writes it: its global shape and chunking, and
    the shards it owns (the first replica of each), copied to host memory."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    shards: list[tuple[tuple[slice, ...], np.ndarray]]


class _Save:
    """One checkpoint save. Creating it copies the state to host memory, after which the
    device buffers may be reused; :meth:`write` writes, waits for the other processes, and
    commits. Each process makes its own, with the same arguments."""

    def __init__(self, state: Any, final: str, *, step: int, temporary: bool, metadata: dict | None):
        self.final = final
        self.step = step
        self.temporary = temporary
        self.metadata = metadata or {}
        self.token = _agreed_token()
        # an object store cannot rename a directory: the save goes straight to its place
        self.staging = f"{final}.tmp-{self.token}" if is_local(final) else final
        leaves, _, names = _flatten(state)
        arrays = {name: _unwrap(leaves[i]) for name, i in names.items()}
        self.leaves = [_describe(name, x) for name, x in arrays.items()]
        self.arrays = _copy_to_host({name: _stored_form(x) for name, x in arrays.items()})

    def write(self) -> None:
        local = is_local(self.final)
        try:
            if local:
                os.makedirs(self.staging, exist_ok=True)
            elif not self._clear_place():
                return
            checksums = _write_arrays(self.staging, self.arrays)
            # each process checksummed the chunks it wrote; process 0 records them all
            gathered = distributed.gather(f"checkpoint_checksums_{self.token}", json.dumps(checksums))
            distributed.barrier(f"checkpoint_written_{self.token}")  # no device collective: safe here
            if jax.process_index() == 0:
                merged: dict[str, dict[str, str]] = {}
                for part in gathered:
                    for name, sums in json.loads(part).items():
                        merged.setdefault(name, {}).update(sums)
                described = {
                    "step": self.step,
                    "temporary": self.temporary,
                    "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
                    "leaves": [{**leaf, CHECKSUM: merged.get(leaf["name"], {})} for leaf in self.leaves],
                    "metadata": self.metadata,
                }
                fileio.write_text(join(self.staging, METADATA_FILE), json.dumps(described, indent=1))
                marker = json.dumps({"step": self.step, "leaves": len(self.leaves)})
                fileio.write_text(join(self.staging, COMMIT_MARKER), marker + "\n")  # the commit
                if local:
                    _move_into_place(self.staging, self.final)
        except BaseException:
            if jax.process_index() == 0:
                try:
                    if local or _marker_problem(self.final) is not None:
                        fileio.remove_tree(self.staging)
                except Exception as e:  # the store may be what failed; the next run clears it then
                    logger.warning("could not remove the unfinished save %s: %s", self.staging, e)
            raise
        finally:
            self.arrays = []  # the host copy is no longer needed
        distributed.barrier(f"checkpoint_committed_{self.token}")

    def _clear_place(self) -> bool:
        """On an object store, before writing into ``step-N/``: False (nothing to write) if a
        complete checkpoint of step N is there already; else process 0 removes what an
        unfinished save left there, or sets a damaged checkpoint aside, while the others wait."""
        marker, problem = _parse_marker(self.final)
        if marker is not None:  # every process reads the same marker, so all of them agree
            logger.warning("%s already exists and is complete: keeping it and discarding this save", self.final)
            self.arrays = []
            distributed.barrier(f"checkpoint_committed_{self.token}")
            return False
        if jax.process_index() == 0 and fileio.list_names(self.final):
            if _marker_exists(self.final):  # a marker that cannot be read: damage, kept for inspection
                aside = f"{self.final}.damaged-{secrets.token_hex(4)}"
                logger.warning("%s exists but is damaged (%s): moving it to %s", self.final, problem, aside)
                fileio.move_tree(self.final, aside)
            else:
                logger.info("removing %s, left by a save that did not finish", self.final)
                fileio.remove_tree(self.final)
        distributed.barrier(f"checkpoint_cleared_{self.token}")
        return True


def _copy_to_host(arrays: dict[str, jax.Array]) -> list[_HostArray]:
    """Copy the shards this process writes to host memory, every transfer started before any is
    awaited. On CPU a device buffer *is* host memory, so it is copied: the training step that
    follows may reuse it (donation)."""
    owned = {name: [s for s in x.addressable_shards if s.replica_id == 0] for name, x in arrays.items()}
    data = {name: [s.data for s in shards] for name, shards in owned.items()}
    for pieces in data.values():
        for piece in pieces:
            piece.copy_to_host_async()
    copied = []
    for name, x in arrays.items():
        shard_shape = x.sharding.shard_shape(x.shape)
        host = []
        for shard, piece in zip(owned[name], data[name]):
            value = np.asarray(piece)
            if shard.device.platform == "cpu" or not value.flags.owndata:
                value = value.copy()
            host.append((shard.index, value))
        copied.append(_HostArray(name, x.shape, jnp.dtype(x.dtype).name, _chunk_shape(shard_shape, x.dtype), host))
    return copied


def _chunk_shape(shard_shape: tuple[int, ...], dtype: Any) -> tuple[int, ...]:
    """The shard's shape, with its largest dimensions halved (or cut by their smallest factor)
    until a chunk holds at most ``_MAX_CHUNK_BYTES``; every chunk lies inside one shard."""
    chunks = [max(d, 1) for d in shard_shape]
    itemsize = jnp.dtype(dtype).itemsize
    while chunks and int(np.prod(chunks)) * itemsize > _MAX_CHUNK_BYTES:
        axis = max(range(len(chunks)), key=lambda a: chunks[a])
        factor = next((f for f in range(2, chunks[axis] + 1) if chunks[axis] % f == 0), None)
        if factor is None or chunks[axis] == 1:
            break
        chunks[axis] //= factor
    return tuple(chunks)


def _zarr_spec(checkpoint: str, name: str, **options: Any) -> dict:
    return {"driver": "zarr", "kvstore": fileio.kvstore_spec(join(checkpoint, name)), **options}


def _write_arrays(directory: str, arrays: list[_HostArray]) -> dict[str, dict[str, str]]:
    """Write this process's shards of ``arrays`` under ``directory``; return the checksum of
    every chunk written, by array name and chunk key. The checksums are computed while
    TensorStore compresses and writes, from the same host memory."""

    async def write(array: _HostArray) -> dict[str, str]:
        spec = _zarr_spec(
            directory,
            array.name,
            dtype=array.dtype,
            metadata={
                "shape": list(array.shape),
                "chunks": list(array.chunks),
                "compressor": {"id": "zstd", "level": 1},
            },
            # Every chunk is written, even one equal to the fill value, so that a missing
            # chunk file always means damage (loading refuses it).
            store_data_equal_to_fill_value=True,
        )
        # Process 0 writes the array's metadata; the others write their chunks alongside it.
        if jax.process_index() == 0:
            store = await ts.open(spec, create=True, open=True)
        else:
            store = await ts.open(spec, open=True, assume_metadata=True)
        writes = [store[index].write(value) for index, value in array.shards]  # under way at once
        checksums = await asyncio.to_thread(_shard_checksums, array)
        await asyncio.gather(*writes)
        return checksums

    async def write_all():
        # wait for every write, even after one fails, so that none is still writing
        # into the directory while the caller removes it
        return await asyncio.gather(*(write(a) for a in arrays), return_exceptions=True)

    results = asyncio.run(write_all())
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return {array.name: checksums for array, checksums in zip(arrays, results)}


def _shard_checksums(array: _HostArray) -> dict[str, str]:
    """The checksum of every chunk of ``array`` that lies in the shards this process writes."""
    checksums = {}
    for index, value in array.shards:
        region = _box(index, array.shape)
        for key, chunk in _chunks_in(region, array.chunks, array.shape):
            if all(lo <= c0 and c1 <= hi for (lo, hi), (c0, c1) in zip(region, chunk)):
                local = tuple(slice(c0 - lo, c1 - lo) for (lo, _), (c0, c1) in zip(region, chunk))
                checksums[key] = _checksum(value[local])
    return checksums


def _checksum(value: np.ndarray) -> str:
    """The XXH3-64 digest (hex) of ``value``'s bytes in C order."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(value).reshape(-1).view(np.uint8))


def _box(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The ``(start, stop)`` of each dimension that the shard ``index`` (slices) covers."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape)) + tuple((0, n) for n in shape[len(index) :])


def _chunks_in(
    box: tuple[tuple[int, int], ...], chunks: tuple[int, ...], shape: tuple[int, ...]
) -> Iterator[tuple[str, tuple[tuple[int, int], ...]]]:
    """Every chunk of an array of ``shape`` cut into ``chunks`` that overlaps ``box``: its key
    (zarr's name of its file, ``"2.0"``; ``"0"`` for a scalar) and its own box, cut at the
    array's end."""
    ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(box, chunks)]
    for grid in itertools.product(*ranges):
        key = ".".join(str(g) for g in grid) or "0"
        yield key, tuple((g * c, min((g + 1) * c, n)) for g, c, n in zip(grid, chunks, shape))


def _move_into_place(staging: str, final: str) -> None:
    """Rename the committed ``staging`` directory to ``final``."""
    if _names_one_checkpoint(final) and _marker_problem(final) is None:
        logger.warning("%s already exists and is complete: keeping it and discarding this save", final)
        shutil.rmtree(staging)
        return
    if os.path.exists(final):
        # Damaged, and not set aside (e.g. a run that did not resume from this directory).
        aside = f"{final}.damaged-{secrets.token_hex(4)}"
        logger.warning("%s exists but is damaged: moving it to %s", final, aside)
        os.rename(final, aside)
    os.rename(staging, final)


# -- reading ---------------------------------------------------------------------------------


class _ChecksumMismatch(Exception):
    """A chunk whose bytes differ from those saved (see the module docstring)."""


def _read_arrays(checkpoint: str, wanted: dict[str, tuple[Any, dict]]) -> dict[str, jax.Array]:
    """Read each ``name -> (template leaf, stored description)``, checking every chunk against
    its recorded checksum; every failure is reported at once."""
    unverified = [name for name, (_, stored) in wanted.items() if CHECKSUM not in stored]
    if unverified:
        logger.info(
            "%s was saved without checksums (before they were recorded): %d array(s) load unverified",
            checkpoint, len(unverified),
        )  # fmt: skip

    async def read(template: Any, stored: dict) -> jax.Array:
        # a template without a sharding loads whole on this process's first device (with several
        # processes, global device 0 belongs to process 0 alone)
        sharding = getattr(template, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.eval_shape(jax.random.key_data, template) if _is_key(template) else template
        spec = _zarr_spec(
            checkpoint,
            stored["name"],
            dtype=jnp.dtype(target.dtype).name,
            metadata={"shape": list(target.shape)},
            # zarr would silently read a missing chunk as zeros
            fill_missing_data_reads=False,
        )
        store = await ts.open(spec, open=True, read=True)
        arr = await _read_verified(store, stored.get(CHECKSUM), tuple(target.shape), sharding)
        return jax.random.wrap_key_data(arr, impl=stored["key_impl"]) if _is_key(template) else arr

    async def read_all():
        return await asyncio.gather(*(read(t, s) for t, s in wanted.values()), return_exceptions=True)

    results = dict(zip(wanted, asyncio.run(read_all())))
    unreadable, changed = [], []
    for name, result in results.items():
        if isinstance(result, ValueError) and _TENSORSTORE_STATUS.match(str(result)):
            unreadable.append(f"  {name}: {_tensorstore_message(result)}")
        elif isinstance(result, _ChecksumMismatch):
            changed.append(f"  {name}: {result}")
        elif isinstance(result, BaseException):
            raise result
    problems = []
    if unreadable:
        problems.append(f"{len(unreadable)} array(s) cannot be read in full:\n" + "\n".join(unreadable))
    if changed:
        problems.append(
            f"{len(changed)} array(s) differ from what was saved (their checksums do not match; "
            "the files changed after they were written):\n" + "\n".join(changed)
        )
    if problems:
        raise DamagedCheckpointError(f"checkpoint {checkpoint} is damaged: " + "\n".join(problems))
    return results


async def _read_verified(
    store: ts.TensorStore, checksums: dict[str, str] | None, shape: tuple[int, ...], sharding: jax.sharding.Sharding
) -> jax.Array:
    """The array in ``store``, placed as ``sharding`` says (on this process's devices), read
    whole chunk by whole chunk so that each is checked against ``checksums`` (chunk key ->
    checksum; None: none recorded) before it is used. Raises :class:`_ChecksumMismatch`."""
    chunks = tuple(store.chunk_layout.read_chunk.shape or ())  # None for a scalar
    read: dict[str, asyncio.Future] = {}

    async def chunk(key: str, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        data = await store[tuple(slice(lo, hi) for lo, hi in box)].read()
        expected = None if checksums is None else checksums.get(key)
        if expected is not None:
            found = await asyncio.to_thread(_checksum, data)
            if found != expected:
                raise _ChecksumMismatch(f"chunk {key} reads with {CHECKSUM} {found}, it was saved with {expected}")
        return data

    # one read per chunk, however many of this process's devices need it
    regions: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        regions.setdefault(_box(index, shape), []).append(device)
    needed = {key: box for region in regions for key, box in _chunks_in(region, chunks, shape)}
    for key, box in needed.items():
        read[key] = asyncio.ensure_future(chunk(key, box))
    try:
        await asyncio.gather(*read.values())
    finally:
        for future in read.values():  # after one failed, the others are not waited for
            future.cancel()

    pieces = []
    for region, devices in regions.items():
        parts = list(_chunks_in(region, chunks, shape))
        if len(parts) == 1 and parts[0][1] == region:
            host = read[parts[0][0]].result()  # the region is one chunk: no copy
        else:
            host = np.empty([hi - lo for lo, hi in region], dtype=store.dtype.numpy_dtype)
            for key, box in parts:
                overlap = [(max(lo, c0), min(hi, c1)) for (lo, hi), (c0, c1) in zip(region, box)]
                into = tuple(slice(a - lo, b - lo) for (lo, _), (a, b) in zip(region, overlap))
                out_of = tuple(slice(a - c0, b - c0) for (c0, _), (a, b) in zip(box, overlap))
                host[into] = read[key].result()[out_of]
        pieces += [jax.device_put(host, device) for device in devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)


def _tensorstore_message(error: ValueError) -> str:
    # TensorStore appends the whole JSON spec, which hides the useful part.
    return str(error).split(" [tensorstore_spec=")[0]


def _check_fits(checkpoint: str, expected: dict[str, dict], stored: dict[str, dict]) -> None:
    """Raise a CheckpointError listing every leaf whose name, shape or dtype differs."""

    def show(leaf: dict) -> str:
        return f"{leaf['dtype']}{leaf['shape']}"

    problems = []
    for name, want in expected.items():
        found = stored.get(name)
        if found is None:
            problems.append(f"  {name}: expected {show(want)}, missing from the checkpoint")
        elif (found["shape"], found["dtype"]) != (want["shape"], want["dtype"]):
            problems.append(f"  {name}: expected {show(want)}, found {show(found)}")
    for name in stored.keys() - expected.keys():
        problems.append(f"  {name}: found {show(stored[name])}, which the training state does not have")
    if problems:
        raise CheckpointError(
            f"checkpoint {checkpoint} does not fit the training state ({len(problems)} leaves differ):\n"
            + "\n".join(sorted(problems))
            + "\nWas it saved with a different model or optimizer configuration?"
        )


# -- markers and directories -----------------------------------------------------------------


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


# -- several processes ------------------------------------------------------------------------


def _agreed_token() -> str:
    """A random token that every process agrees on (they all write into one staging directory).
    Called on the training thread: it is a collective over the devices."""
    token = np.int32(secrets.randbits(31))
    if jax.process_count() > 1:
        token = multihost_utils.broadcast_one_to_all(token)
    return f"{int(token):08x}"
