"""Writing a TensorStore checkpoint: copying the state's shards to host memory, writing them
as zarr arrays (with every chunk's checksum) from every process, and committing the checkpoint
by its ``metadata.json`` and ``COMMITTED`` marker (see :mod:`levanter_core.checkpoint.tensorstore`
for how a save commits locally and on an object store)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import os
import secrets
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from jax.experimental import multihost_utils

from levanter_core import distributed, fileio
from levanter_core.checkpoint.chunks import CHECKSUM, _box, _checksum, _chunk_shape, _chunks_in, _zarr_spec
from levanter_core.checkpoint.layout import (
    COMMIT_MARKER,
    METADATA_FILE,
    _marker_exists,
    _marker_problem,
    _names_one_checkpoint,
    _parse_marker,
)
from levanter_core.checkpoint.leaves import _describe, _flatten, _stored_form, _unwrap
from levanter_core.fileio import is_local, join

logger = logging.getLogger(__name__)


def write_checkpoint(
    state: Any, final: str, *, step: int, temporary: bool = False, metadata: dict | None = None
) -> str:
    """Write ``state`` (any pytree of arrays) as a committed checkpoint at ``final`` and return
    once it is complete: into a staging directory, then ``metadata.json`` (holding ``metadata``)
    and the ``COMMITTED`` marker, then renamed into place."""
    _Save(state, final, step=int(step), temporary=temporary, metadata=metadata).write()
    return final


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
            if gathered is not None:  # process 0 (gather gives the others None)
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


def _agreed_token() -> str:
    """A random token that every process agrees on (they all write into one staging directory).
    Called on the training thread: it is a collective over the devices."""
    token = np.int32(secrets.randbits(31))
    if jax.process_count() > 1:
        token = multihost_utils.broadcast_one_to_all(token)
    return f"{int(token):08x}"
