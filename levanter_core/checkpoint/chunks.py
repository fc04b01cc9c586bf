"""The chunk grid of a checkpoint's zarr arrays: how an array is cut into chunks at save, which
chunks a region covers, each chunk's checksum, and the TensorStore spec of an array; shared by
writing and reading (see :mod:`levanter_core.checkpoint.tensorstore` on checksums)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
import xxhash

from levanter_core import fileio
from levanter_core.fileio import join

# The checksum recorded for every chunk (see :mod:`levanter_core.checkpoint.tensorstore`); the name is the metadata key.
CHECKSUM = "xxh3_64"
# Arrays are chunked along their shards, and shards further split until a chunk holds at most
# this much, so that writing and reading run in parallel and no two processes share a chunk.
_MAX_CHUNK_BYTES = 64 << 20


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


def _checksum(value: np.ndarray) -> str:
    """The XXH3-64 digest (hex) of ``value``'s bytes in C order."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)


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
