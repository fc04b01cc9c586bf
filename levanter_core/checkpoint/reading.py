"""Reading a TensorStore checkpoint into a template pytree: checking that it fits (names,
shapes, dtypes), reading every array whole chunk by whole chunk onto this process's devices,
and checking each chunk against its recorded checksum (see
:mod:`levanter_core.checkpoint.tensorstore`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from typing import Any, cast

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from levanter_core.checkpoint.chunks import CHECKSUM, _box, _checksum, _chunks_in, _zarr_spec
from levanter_core.checkpoint.layout import METADATA_FILE, _read_marker, _resolve_checkpoint, read_metadata
from levanter_core.checkpoint.leaves import _describe, _flatten, _is_key, _unwrap
from levanter_core.errors import CheckpointError, DamagedCheckpointError

logger = logging.getLogger(__name__)

# TensorStore reports missing or unreadable data as a ValueError whose message starts with a
# status code ("NOT_FOUND: chunk {0, 0} ... is missing"); other ValueErrors are not about the data.
_TENSORSTORE_STATUS = re.compile(r"^[A-Z_]+: ")


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


class _ChecksumMismatch(Exception):
    """A chunk whose bytes differ from those saved (see :mod:`levanter_core.checkpoint.tensorstore`)."""


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
    # None for a scalar; tensorstore's type allows unset dimensions, which a stored zarr array has none of
    chunks = cast(tuple[int, ...], tuple(store.chunk_layout.read_chunk.shape or ()))
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
        assert index is not None  # jax's annotation allows None; every sharding gives each device an index
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
