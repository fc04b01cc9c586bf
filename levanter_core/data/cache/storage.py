"""How a cache is reached: its ledger file and its shards' zarr arrays, in a local directory or a
bucket that TensorStore reaches itself, or on any other fsspec filesystem (copied through memory);
and the keys of a shard's arrays. Nothing here knows what the ledger or the arrays mean."""

from __future__ import annotations

import json
import os
import posixpath

import numpy as np
import tensorstore as ts

from levanter_core.fileio import filesystem, is_local, kvstore_spec, local_path, write_text_atomically

LEDGER = "ledger.json"
_CHUNK = 1 << 17  # elements per zarr chunk


_READ_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 256 << 20}})
"""Arrays opened for reading share a cache of decoded chunks, so the sequences of a batch
(and the next batches) rarely decompress a chunk twice. Cached chunks are revalidated
against storage when read, so a growing shard is never read stale."""


def _open_zarr(kvstore: ts.KvStore, create_dtype: np.dtype | None) -> ts.TensorStore | None:
    """The zarr array in ``kvstore``; created empty if missing and ``create_dtype`` is
    given, else None when missing."""
    try:
        context = _READ_CONTEXT if create_dtype is None else None
        return ts.open({"driver": "zarr"}, kvstore=kvstore, open=True, context=context).result()
    except ValueError as e:
        if "NOT_FOUND" not in str(e):
            raise
    if create_dtype is None:
        return None
    return ts.open(
        {"driver": "zarr", "metadata": {"compressor": {"id": "zstd", "level": 3}}},
        kvstore=kvstore,
        create=True,
        dtype=ts.dtype(np.dtype(create_dtype).name),
        shape=[0],
        chunk_layout=ts.ChunkLayout(chunk_shape=[_CHUNK]),
    ).result()


class _KvStorage:
    """A cache that TensorStore reaches itself: a local directory, or gs:// and s3:// buckets."""

    shared = True
    """Whether worker processes see what this process writes (and the reverse)."""

    def __init__(self, spec: dict, local_dir: str | None = None):
        self._spec = spec
        self._local_dir = local_dir

    def _kvstore(self, key: str = "") -> ts.KvStore:
        path = posixpath.join(self._spec["path"], key) if key else self._spec["path"]
        return ts.KvStore.open({**self._spec, "path": path.rstrip("/") + "/" if path.strip("/") else ""}).result()

    def read_ledger(self) -> dict | None:
        if self._local_dir is not None:
            try:
                with open(os.path.join(self._local_dir, LEDGER), encoding="utf-8") as f:
                    return json.load(f)
            except FileNotFoundError:
                return None
        result = self._kvstore().read(LEDGER).result()
        return json.loads(result.value) if result.state == "value" else None

    def write_ledger(self, text: str) -> None:
        if self._local_dir is not None:
            os.makedirs(self._local_dir, exist_ok=True)
            write_text_atomically(os.path.join(self._local_dir, LEDGER), text)
        else:  # one put: object stores replace a key atomically
            self._kvstore().write(LEDGER, text.encode()).result()

    def open_array(self, key: str, create_dtype: np.dtype | None = None) -> ts.TensorStore | None:
        if create_dtype is not None and self._local_dir is not None:
            self._remove_stale_temporaries(os.path.join(self._local_dir, key))
        return _open_zarr(self._kvstore(key), create_dtype)

    @staticmethod
    def _remove_stale_temporaries(directory: str) -> None:
        """Delete the ``*.__lock`` temporaries a killed writer left in ``directory``. TensorStore's
        file kvstore writes a key through ``{key}.__lock`` and renames it, but reuses a stale one
        without truncating it, which corrupts the next write. Only one worker writes a shard at a
        time, so whatever is there is stale."""
        for name in os.listdir(directory) if os.path.isdir(directory) else ():
            if name.endswith(".__lock"):
                os.remove(os.path.join(directory, name))

    def commit(self, key: str) -> None:
        """Nothing to do: TensorStore's writes are durable when they complete."""


class _FsspecStorage:
    """Any other fsspec filesystem (``memory://``, ``hdfs://``...), which TensorStore cannot
    reach: each array lives in an in-memory kvstore whose files are copied with fsspec
    (downloaded when the array is opened, changed ones uploaded by :meth:`commit`)."""

    def __init__(self, url: str):
        self._fs, self._root = filesystem(url)
        protocols = (self._fs.protocol,) if isinstance(self._fs.protocol, str) else self._fs.protocol
        # memory:// lives in this process: other processes cannot see it.
        self.shared = "memory" not in protocols
        self._uploaded: dict[str, tuple[ts.KvStore, dict[bytes, bytes]]] = {}

    def read_ledger(self) -> dict | None:
        try:
            return json.loads(self._fs.cat_file(posixpath.join(self._root, LEDGER)))
        except FileNotFoundError:
            return None

    def write_ledger(self, text: str) -> None:
        self._fs.pipe_file(posixpath.join(self._root, LEDGER), text.encode())

    def open_array(self, key: str, create_dtype: np.dtype | None = None) -> ts.TensorStore | None:
        memory = ts.KvStore.open({"driver": "memory"}).result()
        prefix = posixpath.join(self._root, key)
        for path in self._fs.find(prefix):
            memory.write(posixpath.relpath(path, prefix), self._fs.cat_file(path)).result()
        array = _open_zarr(memory, create_dtype)
        if create_dtype is not None:  # opened for writing: remember what is already uploaded
            generations = {name: memory.read(name).result().stamp.generation for name in memory.list().result()}
            self._uploaded[key] = (memory, generations)
        return array

    def commit(self, key: str) -> None:
        memory, generations = self._uploaded[key]
        for name in memory.list().result():
            seen = generations.get(name)
            result = memory.read(name).result() if seen is None else memory.read(name, if_not_equal=seen).result()
            if result.state == "value":
                self._fs.pipe_file(posixpath.join(self._root, key, name.decode()), result.value)
                generations[name] = result.stamp.generation


def _storage(path: str) -> _KvStorage | _FsspecStorage:
    """How to reach the cache at ``path``."""
    if is_local(path):
        local = local_path(path)
        return _KvStorage({"driver": "file", "path": local}, local_dir=local)
    spec = kvstore_spec(path)
    return _KvStorage(spec) if spec is not None else _FsspecStorage(path)


def _shard_key(index: int, array: str) -> str:
    return f"shards/{index:05d}/{array}"


def _field_key(name: str) -> str:
    return f"field.{name}"


def _field_offsets_key(name: str) -> str:
    return f"field.{name}.offsets"
