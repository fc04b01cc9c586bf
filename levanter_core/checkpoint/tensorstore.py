"""TensorStore checkpoints: every array of the training state as a zarr array.

On disk, under the checkpointer's path (``{base_path}/{run_id}``)::

    step-1000/
      metadata.json        step, temporary, timestamp, every leaf's name/shape/dtype,
                           and the run's metadata (resolved config, plugin versions)
      step/                one zarr array per array leaf, named by its path in the state
      model/transformer/blocks/attn/c_attn/weight/
      opt_state/0/mu/transformer/blocks/attn/c_attn/weight/
      training_key/        a typed PRNG key is stored as its raw key data
      COMMITTED            written last; a directory without it is not a checkpoint

A save writes into ``step-N.tmp-<token>/``, then writes ``COMMITTED`` atomically,
then renames the directory to ``step-N``: whenever a run dies, ``step-N`` is either
absent or complete. Only local paths are supported for now, because renaming a
directory is atomic there and not on object stores.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import os
import re
import secrets
import shutil
from typing import Any, Callable

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.experimental.array_serialization import serialization

from levanter_core.checkpoint.config import Checkpointer
from levanter_core.errors import CheckpointError
from levanter_core.fileio import write_text_atomically

logger = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
METADATA_FILE = "metadata.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.=-]")
# TensorStore reports missing or unreadable data as a ValueError whose message starts with a
# status code ("NOT_FOUND: chunk {0, 0} ... is missing"); other ValueErrors are not about the data.
_TENSORSTORE_STATUS = re.compile(r"^[A-Z_]+: ")


class TensorStoreCheckpointer(Checkpointer):
    """Saves and loads the training state with TensorStore (see the module docstring for
    the layout). Saves are synchronous: :meth:`save` returns once the checkpoint is committed."""

    def __init__(self, path: str, **policy: Any):
        """Takes :class:`Checkpointer`'s arguments; ``path`` must be a local directory."""
        super().__init__(_local_path(path), **policy)

    def save(self, state: Any, step: int, *, temporary: bool, on_commit: Callable[[str], None] | None = None) -> str:
        final = write_checkpoint(
            state, os.path.join(self.path, f"step-{int(step)}"), step=step, temporary=temporary, metadata=self.metadata
        )
        logger.info("saved %s checkpoint %s", "temporary" if temporary else "permanent", final)
        if on_commit is not None:
            on_commit(final)
        return final

    def load(self, template: Any, path: str) -> Any:
        return load_checkpoint(template, path)

    def latest(self) -> str | None:
        return discover_latest(self.path)

    def is_temporary(self, checkpoint_path: str) -> bool:
        return bool(read_metadata(checkpoint_path).get("temporary", False))

    def mark_permanent(self, checkpoint_path: str) -> None:
        if jax.process_index() == 0:
            metadata = read_metadata(checkpoint_path)
            metadata["temporary"] = False
            write_text_atomically(os.path.join(checkpoint_path, METADATA_FILE), json.dumps(metadata, indent=1))

    def delete(self, checkpoint_path: str) -> None:
        if jax.process_index() != 0:
            return
        logger.info("deleting superseded temporary checkpoint %s", checkpoint_path)
        try:
            # The marker goes first: a deletion cut short must not leave a "complete" checkpoint
            # with arrays missing.
            os.remove(os.path.join(checkpoint_path, COMMIT_MARKER))
            shutil.rmtree(checkpoint_path)
        except OSError as e:  # housekeeping: failing to delete an old checkpoint must not stop training
            logger.warning("could not delete %s: %s", checkpoint_path, e)


def write_checkpoint(state: Any, final: str, *, step: int, temporary: bool = False, metadata: dict | None = None) -> str:
    """Write ``state`` (any pytree of arrays) as a committed checkpoint at ``final``: into a
    staging directory first, then the ``COMMITTED`` marker, then renamed into place.
    ``metadata`` (JSON) is stored in ``metadata.json`` under ``metadata``."""
    step = int(step)
    staging = f"{final}.tmp-{_agreed_token()}"
    leaves, _, names = _flatten(state)
    arrays = {name: _unwrap(leaves[i]) for name, i in names.items()}
    os.makedirs(staging, exist_ok=True)
    try:
        _write_arrays(staging, {name: _stored_form(x) for name, x in arrays.items()})
        _sync("levanter_checkpoint_written")
        if jax.process_index() == 0:
            described = {
                "step": step,
                "temporary": temporary,
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "leaves": [_describe(name, x) for name, x in arrays.items()],
                "metadata": metadata or {},
            }
            with open(os.path.join(staging, METADATA_FILE), "w") as f:
                json.dump(described, f, indent=1)
            _commit(staging, final, step)
    except BaseException:
        if jax.process_index() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    _sync("levanter_checkpoint_committed")
    return final


def discover_latest(path: str) -> str | None:
    """``path`` itself if it is a committed checkpoint; else the committed ``step-N``
    directly under it with the highest N; else None."""
    path = _local_path(path)
    if _is_committed(path):
        return path
    if not os.path.isdir(path):
        return None
    steps = []
    for entry in os.listdir(path):
        match = _STEP_DIR.match(entry)
        if match and _is_committed(os.path.join(path, entry)):
            steps.append((int(match.group(1)), entry))
    return os.path.join(path, max(steps)[1]) if steps else None


def read_metadata(checkpoint_path: str) -> dict:
    """The contents of a checkpoint's ``metadata.json``: ``step``, ``temporary``,
    ``timestamp``, ``leaves`` and the run's ``metadata``."""
    file = os.path.join(_local_path(checkpoint_path), METADATA_FILE)
    try:
        with open(file) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint_path} is not a checkpoint: it has no {METADATA_FILE}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}): the checkpoint is damaged") from None


def load_checkpoint(template: Any, path: str, *, subtree: str | None = None) -> Any:
    """Load the checkpoint at ``path`` (a ``step-N`` directory, or a directory of them: the
    latest is used) into the structure of ``template``.

    ``template`` is a pytree like the one saved, whose array leaves are arrays or
    ``jax.ShapeDtypeStruct``\\ s; each loaded array gets its template's sharding (the first
    device when it has none). Leaves that are not arrays are taken from ``template``.
    Raises :class:`CheckpointError`, before reading any data, when names, shapes or dtypes
    differ, and when an array cannot be read in full.

    ``subtree`` loads one part of what was saved: ``subtree="model"`` loads a model
    (``template``) from a checkpoint of a whole training state, or of a model alone.
    """
    checkpoint = discover_latest(path)
    if checkpoint is None:
        raise CheckpointError(
            f"no complete checkpoint at {path}: expected a step-N directory containing {COMMIT_MARKER}, "
            "or a directory holding such step-N directories"
        )
    stored = {leaf["name"]: leaf for leaf in read_metadata(checkpoint)["leaves"]}
    if subtree is not None:
        stored = {name: leaf for name, leaf in stored.items() if name.startswith(subtree + "/")}
        return _load_tree({subtree: template}, checkpoint, stored)[subtree]
    return _load_tree(template, checkpoint, stored)


def _load_tree(template: Any, checkpoint: str, stored: dict[str, dict]) -> Any:
    """Load the leaves ``stored`` (name -> description) of ``checkpoint`` into ``template``."""
    leaves, treedef, names = _flatten(template)
    _check_fits(checkpoint, {name: _describe(name, _unwrap(leaves[i])) for name, i in names.items()}, stored)
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


# -- reading and writing -----------------------------------------------------------------


def _zarr_spec(checkpoint: str, name: str, **options: Any) -> dict:
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(checkpoint, name)}, **options}


def _write_arrays(directory: str, arrays: dict[str, jax.Array]) -> None:
    async def write_all():
        return await asyncio.gather(
            *(
                # Every chunk is written, even one equal to the fill value, so that a missing
                # chunk file always means damage (loading refuses it).
                serialization.async_serialize(arr, _zarr_spec(directory, name, store_data_equal_to_fill_value=True))
                for name, arr in arrays.items()
            ),
            # wait for every write, even after one fails, so that none is still writing
            # into the directory while the caller removes it
            return_exceptions=True,
        )

    for result in asyncio.run(write_all()):
        if isinstance(result, BaseException):
            raise result


def _read_arrays(checkpoint: str, wanted: dict[str, tuple[Any, dict]]) -> dict[str, jax.Array]:
    """Read each ``name -> (template leaf, stored description)``; every failure is reported at once."""

    async def read(template: Any, stored: dict) -> jax.Array:
        sharding = getattr(template, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.eval_shape(jax.random.key_data, template) if _is_key(template) else template
        spec = _zarr_spec(
            checkpoint,
            stored["name"],
            dtype=jnp.dtype(target.dtype).name,
            metadata={"shape": list(target.shape)},
            # zarr would silently read a missing chunk as zeros
            fill_missing_data_reads=False,
        )
        target = jax.ShapeDtypeStruct(target.shape, target.dtype, sharding=sharding)
        arr = await serialization.async_deserialize(target, spec)
        return jax.random.wrap_key_data(arr, impl=stored["key_impl"]) if _is_key(template) else arr

    async def read_all():
        return await asyncio.gather(*(read(t, s) for t, s in wanted.values()), return_exceptions=True)

    results = dict(zip(wanted, asyncio.run(read_all())))
    failures = []
    for name, result in results.items():
        if isinstance(result, ValueError) and _TENSORSTORE_STATUS.match(str(result)):
            failures.append(f"  {name}: {_tensorstore_message(result)}")
        elif isinstance(result, BaseException):
            raise result
    if failures:
        raise CheckpointError(
            f"checkpoint {checkpoint} is damaged: {len(failures)} array(s) cannot be read in full:\n"
            + "\n".join(failures)
            + "\nLoad an earlier checkpoint, or delete this one so that the run resumes from the one before."
        )
    return results


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


# -- committing ----------------------------------------------------------------------------


def _commit(staging: str, final: str, step: int) -> None:
    write_text_atomically(os.path.join(staging, COMMIT_MARKER), f"step {step}\n")
    if _is_committed(final):
        logger.warning("%s already exists and is complete: keeping it and discarding this save", final)
        shutil.rmtree(staging)
        return
    if os.path.exists(final):
        # Never renamed into place without its marker, so this is debris (e.g. a partial copy).
        shutil.rmtree(final)
    os.rename(staging, final)


def _is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMMIT_MARKER))


def _local_path(path: str) -> str:
    if "://" in str(path):
        raise CheckpointError(
            f"checkpoint path {path!r}: only local paths are supported for now; "
            "set trainer.checkpointer.base_path to a local directory"
        )
    return os.path.abspath(os.path.expanduser(str(path)))


# -- several processes ------------------------------------------------------------------------


def _agreed_token() -> str:
    """A random token that every process agrees on (they all write into one staging directory)."""
    token = np.int32(secrets.randbits(31))
    if jax.process_count() > 1:
        token = multihost_utils.broadcast_one_to_all(token)
    return f"{int(token):08x}"


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
