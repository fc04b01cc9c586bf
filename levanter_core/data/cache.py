"""The tokenized cache: each (source, split) tokenized once, kept, resumed, reused.

Layout of one cache at ``path`` (a local directory or an fsspec URL)::

    {path}/ledger.json                 what is finished; written atomically, after the data
    {path}/shards/{i:05d}/tokens       zarr: the shard's documents' ids, concatenated
    {path}/shards/{i:05d}/offsets      zarr int64 [documents + 1]: document boundaries
    {path}/shards/{i:05d}/target_mask  zarr uint8 like tokens (packed formats only)
    {path}/shards/{i:05d}/field.{name}          zarr: a format's own per-document arrays
    {path}/shards/{i:05d}/field.{name}.offsets  zarr int64 [documents + 1]: their boundaries
                                                (formats with document_fields, such as audio)

Shards (the source's files, usually) are independent: workers (:mod:`.executor`)
tokenize whole shards (``data.cache_options.batch_size`` records per tokenizer call),
store what they have each time it reaches ``target_size_per_flush`` bytes, and report
their progress; only the coordinator, a thread of
the process that called :func:`open_cache`, writes the ledger. Everything the ledger
counts is already stored, and a shard resumes from its ledger counts, so a build
killed at any moment continues where it stopped and ends with the same cache as a
build that was never interrupted, with any number of workers.

Training reads the *ready prefix* through :class:`TokenCache`: finished shards
``0..k-1`` and the committed part of shard ``k``, growing while the build runs.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import logging
import os
import posixpath
import threading
import time
from collections.abc import Iterator

import numpy as np
import tensorstore as ts
from tqdm import tqdm

from levanter_core.data.config import CacheOptions
from levanter_core.data.executor import BuildStopped, Progress, ShardTask, connect, run_shards
from levanter_core.data.source import DataSourceConfig, Record
from levanter_core.data.tokenizer import Tokenizer, load_tokenizer
from levanter_core.errors import DataError, UserError
from levanter_core.fileio import filesystem, is_local, kvstore_spec, local_path, write_text_atomically

logger = logging.getLogger(__name__)

CACHE_FORMAT = 2
LEDGER = "ledger.json"
LEDGER_INTERVAL = 0.5
"""Least seconds between two ledger writes, except when a shard finishes or the build ends."""
MAX_PROBLEMS = 10
"""Messages of skipped records kept in the ledger (all are counted)."""
STALE_AFTER = 600.0
"""A reader waiting on another process's build gives up after this many seconds without progress."""
SKIP_BAD_DATA_HINT = "set data.skip_bad_data: true to skip such records and count them"
"""What a bad record stops the build with (a training config's setting)."""
_CHUNK = 1 << 17  # elements per zarr chunk


# -- storage ----------------------------------------------------------------------------------


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


# -- the workers' side: one shard -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every worker needs to tokenize any shard of one cache (pickled to workers)."""

    path: str
    source: DataSourceConfig
    split: str
    tokenizer: str
    tokenizer_fingerprint: str
    eos_id: int | None
    skip_bad_data: bool
    token_dtype: str
    batch_size: int
    """Records encoded by one call of the tokenizer (``cache_options.batch_size``)."""
    flush_bytes: int
    """Encoded bytes accumulated before they are stored and reported (one resume point each;
    ``cache_options.target_size_per_flush``)."""


RECORDS_PER_STORE = 1000
"""What a worker has encoded is also stored after at most this many records, however small:
training reads only stored data, and each store is a resume point, so a large shard becomes
readable (and survives a kill) as it goes, not only at ``target_size_per_flush``."""


@functools.lru_cache(maxsize=4)
def _worker_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer, loaded once per worker process."""
    return load_tokenizer(spec)


def _field_key(name: str) -> str:
    return f"field.{name}"


def _field_offsets_key(name: str) -> str:
    return f"field.{name}.offsets"


class _ShardWriter:
    """Stores a shard's documents in its arrays, from given positions on."""

    def __init__(self, storage, index: int, token_dtype: np.dtype, packed: bool, fields: dict[str, str]):
        self._storage = storage
        self._index = index
        self._dtype = token_dtype
        self._fields = {name: np.dtype(dtype) for name, dtype in fields.items()}
        names = {"tokens": token_dtype, "offsets": np.int64} | ({"target_mask": np.uint8} if packed else {})
        for name, dtype in self._fields.items():
            names |= {_field_key(name): dtype, _field_offsets_key(name): np.int64}
        self._arrays = {name: storage.open_array(_shard_key(index, name), np.dtype(dt)) for name, dt in names.items()}
        self._field_ends: dict[str, int] | None = None  # values stored per field, known once writing starts

    def write(self, documents: int, tokens: int, encoded: list) -> None:
        """Store ``encoded`` as documents ``documents...`` starting at token ``tokens``."""
        lengths = np.array([len(e.ids) for e in encoded], np.int64)
        self._put("offsets", documents, tokens + np.concatenate([[0], np.cumsum(lengths)]))
        for name in self._fields:
            self._write_field(name, documents, [e.fields[name] for e in encoded])
        if not encoded:
            return
        self._put("tokens", tokens, np.concatenate([e.ids for e in encoded]).astype(self._dtype))
        if "target_mask" in self._arrays:
            self._put("target_mask", tokens, np.concatenate([e.target_mask for e in encoded]).astype(np.uint8))

    def _write_field(self, name: str, documents: int, values: list[np.ndarray]) -> None:
        if self._field_ends is None:
            # Where each field's stored values end: the offset of document `documents`, which
            # the ledger counts as stored (0 for a shard that starts now).
            self._field_ends = {}
            for field in self._fields:
                key = _field_offsets_key(field)
                self._field_ends[field] = int(self._arrays[key][documents].read().result()) if documents else 0
        start = self._field_ends[name]
        lengths = np.array([len(v) for v in values], np.int64)
        self._put(_field_offsets_key(name), documents, start + np.concatenate([[0], np.cumsum(lengths)]))
        if values:
            self._put(_field_key(name), start, np.concatenate(values).astype(self._fields[name], copy=False))
        self._field_ends[name] = start + int(lengths.sum())

    def _put(self, name: str, start: int, values: np.ndarray) -> None:
        end = start + len(values)
        # Anything stored past `start` is from an interrupted run: the ledger never counted it.
        array = self._arrays[name].resize(exclusive_max=[end], resize_metadata_only=True).result()
        array[start:end].write(values).result()
        self._arrays[name] = array
        self._storage.commit(_shard_key(self._index, name))


def _skip_reason(error: DataError, where: str) -> str:
    """A short name for why a record was skipped: its message without the place, up to the
    first detail (``not valid JSON``, ``no 'text' field``...)."""
    message = str(error).removeprefix(f"{where}: ")
    for stop in (" (", ": ", "; ", ", "):
        message = message.split(stop, 1)[0]
    return message


def tokenize_shard(job: _Job, task: ShardTask) -> Iterator[Progress]:
    """Tokenize one shard from its resume point, ``job.batch_size`` records per tokenizer
    call, storing what is encoded each time it reaches ``job.flush_bytes`` or
    ``RECORDS_PER_STORE`` records (and at the shard's end) before reporting it. A bad record raises its :class:`DataError` unless
    ``job.skip_bad_data``. How the work is batched never changes what is stored."""
    tokenizer = _worker_tokenizer(job.tokenizer)
    if tokenizer.fingerprint != job.tokenizer_fingerprint:
        raise DataError(f"data.tokenizer: {job.tokenizer!r} changed while the cache {job.path} was being built")
    fmt = job.source.format
    fields = fmt.document_fields()
    writer = _ShardWriter(_storage(job.path), task.index, np.dtype(job.token_dtype), fmt.packed, fields)
    pending = _Pending(Progress(task.index, task.records, task.documents, task.tokens, dict(task.skipped), [], False))
    # Bytes stored per token (its id, and its target-mask flag) and per document (its offsets).
    token_bytes = np.dtype(job.token_dtype).itemsize + (1 if fmt.packed else 0)
    document_bytes = 8 * (1 + len(fields))
    batch: list[Record] = []
    for record in job.source.records(job.split, task.name, task.records):
        batch.append(record)
        if len(batch) == job.batch_size:
            _encode_batch(job, tokenizer, pending, batch)
            batch = []
            stored = pending.tokens * token_bytes + document_bytes * len(pending.documents) + pending.field_bytes
            full = stored >= job.flush_bytes
            if full or pending.records >= RECORDS_PER_STORE:
                yield pending.store(writer)
    if batch:
        _encode_batch(job, tokenizer, pending, batch)
    yield dataclasses.replace(pending.store(writer), finished=True)


class _Pending:
    """Documents encoded since the last store, over the shard's progress up to it."""

    def __init__(self, stored: Progress):
        self.stored = stored
        self.documents: list = []
        self.tokens = 0
        self.field_bytes = 0
        self.records = 0
        self.skipped = collections.Counter(stored.skipped)
        self.problems: list[str] = []

    def store(self, writer: _ShardWriter) -> Progress:
        """Write the pending documents; the progress that now counts them."""
        before = self.stored
        writer.write(before.documents, before.tokens, self.documents)
        self.stored = Progress(
            index=before.index,
            records=before.records + self.records,
            documents=before.documents + len(self.documents),
            tokens=before.tokens + self.tokens,
            skipped=dict(sorted(self.skipped.items())),
            problems=self.problems[:MAX_PROBLEMS],
            finished=False,
        )
        self.documents, self.tokens, self.field_bytes, self.records, self.problems = [], 0, 0, 0, []
        return self.stored


def _encode_batch(job: _Job, tokenizer: Tokenizer, pending: _Pending, batch: list[Record]) -> None:
    fmt = job.source.format
    readable = [r for r in batch if not isinstance(r.value, DataError)]
    encoded = iter(fmt.encode_batch([r.value for r in readable], [r.where for r in readable], tokenizer, job.eos_id))
    fields = fmt.document_fields()
    for record in batch:
        result = record.value if isinstance(record.value, DataError) else next(encoded)
        if not isinstance(result, DataError):
            if fields:
                _check_fields(fmt, result, fields, record.where)
            pending.documents.append(result)
            pending.tokens += len(result.ids)
            pending.field_bytes += sum(v.nbytes for v in (result.fields or {}).values())
        elif job.skip_bad_data:
            pending.skipped[_skip_reason(result, record.where)] += 1
            pending.problems.append(str(result))
        else:
            raise DataError(f"{result} ({SKIP_BAD_DATA_HINT})")
    pending.records += len(batch)


def _check_fields(fmt, encoded, fields: dict[str, str], where: str) -> None:
    """A format that declares document fields must give each document every one of them, as a
    one-dimensional array (a mistake of the format's plugin, not of the data)."""
    given = encoded.fields or {}
    for name in fields:
        value = given.get(name)
        if not isinstance(value, np.ndarray) or value.ndim != 1:
            found = "nothing" if value is None else f"{type(value).__name__} {getattr(value, 'shape', '')}"
            raise TypeError(
                f"{where}: the {type(fmt).__name__} format declares the document field {name!r} but encoded this "
                f"record with {found} for it (expected a one-dimensional numpy array)"
            )


# -- the ledger -------------------------------------------------------------------------------


def _identity(tokenizer: Tokenizer, source: DataSourceConfig, enforce_eos: bool) -> dict:
    return {
        "tokenizer": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "format": source.format.fingerprint(),
        "enforce_eos": enforce_eos,
    }


def _new_ledger(split: str, identity: dict, tokenizer: Tokenizer, source: DataSourceConfig, fingerprint: dict) -> dict:
    return {
        "format": CACHE_FORMAT,
        "split": split,
        "identity": identity,
        "tokenizer_name": tokenizer.name,
        "source": {k: v for k, v in fingerprint.items() if k != "shards"},
        "shards": [_new_shard(name, fp) for name, fp in fingerprint["shards"].items()],
        "complete": False,
        "num_documents": 0,
        "num_tokens": 0,
        "token_dtype": "uint16" if tokenizer.vocab_size <= 1 << 16 else "int32",
        "target_mask": source.format.packed,
        "fields": source.format.document_fields(),
        "problems": [],
        "updated": None,
    }


def _new_shard(name: str, fingerprint) -> dict:
    return {
        "name": name,
        "fingerprint": fingerprint,
        "records": 0,
        "documents": 0,
        "tokens": 0,
        "finished": False,
        "skipped": {},
    }


def _reconcile(path: str, old: dict, new: dict) -> dict:
    """The ledger to continue from: ``old`` (what is stored) checked against ``new`` (what the
    configuration asks for). Raises :class:`DataError` saying what differs if the stored data
    cannot be reused; a changed unfinished shard simply starts again."""
    remedy = f"remove {path} to build it again, or choose another data.cache_dir"
    if old.get("format") != CACHE_FORMAT:
        raise DataError(f"{path}: cache format {old.get('format')!r}, this version reads {CACHE_FORMAT}; {remedy}")
    differences = [
        f"{key} (cached: {old['identity'].get(key)!r}, now: {value!r})"
        for key, value in new["identity"].items()
        if old["identity"].get(key) != value
    ]
    if old["source"] != new["source"]:
        differences.append(f"source (cached: {old['source']!r}, now: {new['source']!r})")
    old_names, new_names = [s["name"] for s in old["shards"]], [s["name"] for s in new["shards"]]
    if old_names != new_names:
        added = [n for n in new_names if n not in old_names]
        removed = [n for n in old_names if n not in new_names]
        differences.append(
            f"inputs (added: {added or 'none'}, removed: {removed or 'none'}{'' if added or removed else ', reordered'})"
        )
    else:
        for stored, wanted in zip(old["shards"], new["shards"]):
            if stored["finished"] and stored["fingerprint"] != wanted["fingerprint"]:
                differences.append(
                    f"input {wanted['name']} changed after it was cached (cached: {stored['fingerprint']!r}, now: {wanted['fingerprint']!r})"
                )
    if differences:
        tokenizer_note = (
            f" (tokenizer {old.get('tokenizer_name')!r})" if any(d.startswith("tokenizer") for d in differences) else ""
        )
        raise DataError(
            f"{path}: this cache was built from other settings{tokenizer_note}: {'; '.join(differences)}; {remedy}"
        )
    ledger = copy.deepcopy(old)
    for i, (stored, wanted) in enumerate(zip(old["shards"], new["shards"])):
        if stored["fingerprint"] != wanted["fingerprint"]:
            logger.warning("%s: input %s changed before it was finished; tokenizing it again", path, wanted["name"])
            ledger["shards"][i] = wanted
    return ledger


def _ready(ledger: dict) -> tuple[list[dict], int, int]:
    """The shards of the ready prefix (finished ones and the committed part of the first
    unfinished one), with its document and token counts."""
    ready = []
    for shard in ledger["shards"]:
        ready.append(shard)
        if not shard["finished"]:
            break
    return ready, sum(s["documents"] for s in ready), sum(s["tokens"] for s in ready)


def _no_documents(path: str, split: str, ledger: dict) -> DataError:
    names = [s["name"] for s in ledger["shards"]]
    listing = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    skipped = collections.Counter()
    for shard in ledger["shards"]:
        skipped.update(shard["skipped"])
    note = f" ({sum(skipped.values())} records skipped: {dict(skipped)})" if skipped else ""
    return DataError(
        f"the {split} split has no documents{note}: its inputs {listing} hold no usable records (cache {path})"
    )


# -- the coordinator --------------------------------------------------------------------------


class _Build:
    """Builds one cache: hands its unfinished shards to workers, keeps the ledger from their
    reports, and wakes readers waiting for more."""

    def __init__(
        self,
        path: str,
        storage,
        ledger: dict,
        job: _Job,
        *,
        num_workers: int,
        num_shard_groups: int | None,
        ray,
        progress: bool,
    ):
        self.path = path
        self.condition = threading.Condition()
        self.ledger = ledger  # guarded by `condition`
        self.version = 0
        self.error: BaseException | None = None
        self.done = False
        self._storage = storage
        self._job = job
        self._num_workers = num_workers
        self._num_shard_groups = num_shard_groups
        self._ray = ray
        self._progress = progress
        self._stop = threading.Event()
        self._last_write = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Build in a background thread."""
        self._thread = threading.Thread(target=self._run_in_background, name=f"cache {self.path}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the workers and wait for the coordinator to leave the ledger consistent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def run(self) -> None:
        """Build to completion here; raises the build's error."""
        tasks = [
            ShardTask(i, s["name"], s["records"], s["documents"], s["tokens"], dict(s["skipped"]))
            for i, s in enumerate(self.ledger["shards"])
            if not s["finished"]
        ]
        started, tokens_before = time.monotonic(), self.ledger["num_tokens"]
        bar = tqdm(
            total=len(self.ledger["shards"]),
            initial=len(self.ledger["shards"]) - len(tasks),
            desc=f"tokenizing {self.ledger['split']}",
            unit="shard",
            disable=not self._progress,
        )
        try:
            self._write_ledger(force=True)
            run_shards(
                functools.partial(tokenize_shard, self._job),
                tasks,
                lambda p: self._report(p, bar, started),
                num_workers=self._num_workers,
                max_groups=self._num_shard_groups,
                ray=self._ray,
                stop=self._stop,
                processes=self._storage.shared,
            )
            with self.condition:
                if self.ledger["num_documents"] == 0:
                    raise _no_documents(self.path, self.ledger["split"], self.ledger)
                self.ledger["complete"] = True
        except BaseException as e:
            with self.condition:
                stopped = isinstance(e, BuildStopped)
                self.error = (
                    DataError(f"{self.path}: the cache build was stopped before it completed") if stopped else e
                )
            raise
        finally:
            bar.close()
            self._write_ledger(force=True)
            with self.condition:
                self.done = True
                self.version += 1
                self.condition.notify_all()
        seconds = time.monotonic() - started
        made = self.ledger["num_tokens"] - tokens_before
        logger.info(
            "built the cache %s: %d documents, %d tokens (%d new in %.1fs, %.3g tokens/s)",
            self.path,
            self.ledger["num_documents"],
            self.ledger["num_tokens"],
            made,
            seconds,
            made / max(seconds, 1e-9),
        )

    def _run_in_background(self) -> None:
        try:
            self.run()
        except BuildStopped:
            logger.info("stopped building the cache %s", self.path)
        except UserError:
            pass  # a problem with the data: every reader raises it, with its message
        except BaseException:
            logger.exception("building the cache %s failed", self.path)

    def _report(self, p: Progress, bar: tqdm, started: float) -> None:
        with self.condition:
            shard = self.ledger["shards"][p.index]
            shard.update(
                records=p.records, documents=p.documents, tokens=p.tokens, skipped=p.skipped, finished=p.finished
            )
            problems = self.ledger["problems"]
            problems.extend(p.problems[: MAX_PROBLEMS - len(problems)])
            self.ledger["num_documents"] = sum(s["documents"] for s in self.ledger["shards"])
            self.ledger["num_tokens"] = sum(s["tokens"] for s in self.ledger["shards"])
            self.version += 1
            self.condition.notify_all()
            docs, tokens = self.ledger["num_documents"], self.ledger["num_tokens"]
        self._write_ledger(force=p.finished)
        rate = tokens / max(time.monotonic() - started, 1e-9)
        bar.set_postfix(docs=docs, tokens=tokens, tokens_per_s=f"{rate:.3g}", refresh=False)
        bar.update(1 if p.finished else 0)

    def _write_ledger(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_write < LEDGER_INTERVAL:
            return
        with self.condition:
            self.ledger["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            text = json.dumps(self.ledger, indent=1)
        self._storage.write_ledger(text)
        self._last_write = now

    def snapshot(self) -> tuple[int, dict]:
        with self.condition:
            return self.version, copy.deepcopy(self.ledger)


# -- the reader -------------------------------------------------------------------------------


class TokenCache:
    """The tokenized documents of one (source, split): the ready prefix of a cache that may
    still be growing. Token positions are global: shard after shard, in order."""

    def __init__(self, path: str, storage, ledger: dict, build: _Build | None = None):
        self.path = path
        self._storage = storage
        self._build = build
        self._version = -1
        self._last_poll = time.monotonic()
        self._arrays: dict[tuple[int, str], ts.TensorStore] = {}
        self._offsets: dict[tuple[int, str], np.ndarray] = {}
        self._set_ledger(ledger)

    # -- state

    def _set_ledger(self, ledger: dict) -> None:
        self._ledger = ledger
        skipped = collections.Counter()
        for shard in ledger["shards"]:
            skipped.update(shard["skipped"])
        self._skipped = dict(sorted(skipped.items()))  # read every training step: counted once per ledger
        shards, self._num_documents, self._num_tokens = _ready(ledger)
        self._shards = shards
        counts = np.array([[s["documents"], s["tokens"]] for s in shards], np.int64).reshape(-1, 2)
        self._doc_starts = np.concatenate([[0], np.cumsum(counts[:, 0])])
        self._token_starts = np.concatenate([[0], np.cumsum(counts[:, 1])])

    def _refresh(self) -> None:
        if self._ledger["complete"]:
            return
        if self._build is not None:
            if self._build.version != self._version:
                self._version, ledger = self._build.snapshot()
                self._set_ledger(ledger)
        elif time.monotonic() - self._last_poll >= 1.0:
            self._last_poll = time.monotonic()
            self._set_ledger(self._storage.read_ledger() or self._ledger)

    @property
    def ledger(self) -> dict:
        self._refresh()
        return self._ledger

    @property
    def complete(self) -> bool:
        self._refresh()
        return self._ledger["complete"]

    @property
    def num_documents(self) -> int:
        self._refresh()
        return self._num_documents

    @property
    def num_tokens(self) -> int:
        self._refresh()
        return self._num_tokens

    @property
    def has_target_mask(self) -> bool:
        return self._ledger["target_mask"]

    @property
    def fields(self) -> dict[str, str]:
        """The format's per-document arrays this cache holds: name -> dtype name."""
        return dict(self._ledger.get("fields") or {})

    def skipped(self) -> dict[str, int]:
        """Records skipped (``data.skip_bad_data``), by reason."""
        self._refresh()
        return dict(self._skipped)

    def problems(self) -> list[str]:
        """The messages of the first few skipped records."""
        return list(self.ledger["problems"])

    # -- data

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Token ids at global positions ``start..stop-1`` of the ready prefix, as int32."""
        return self._read("tokens", start, stop, np.int32)

    def target_mask(self, start: int, stop: int) -> np.ndarray | None:
        """The target mask (uint8) at positions ``start..stop-1``; None for formats without one."""
        return self._read("target_mask", start, stop, np.uint8) if self.has_target_mask else None

    def document_offsets(self) -> np.ndarray:
        """int64 ``[num_documents + 1]``: document ``i`` is tokens ``offsets[i]..offsets[i+1]-1``."""
        self._refresh()
        pieces = [np.zeros(1, np.int64)]
        for i, shard in enumerate(self._shards):
            if shard["documents"]:
                offsets = self._shard_offsets(i, shard)
                pieces.append(offsets[1 : shard["documents"] + 1] + self._token_starts[i])
        return np.concatenate(pieces)

    def _shard_offsets(self, index: int, shard: dict, key: str = "offsets") -> np.ndarray:
        if (index, key) in self._offsets:
            return self._offsets[(index, key)]
        offsets = self._array(index, key, shard)[: shard["documents"] + 1].read().result()
        offsets = offsets - offsets[0]
        if shard["finished"]:
            self._offsets[(index, key)] = offsets
        return offsets

    def document_field(self, name: str, documents) -> list[np.ndarray]:
        """Field ``name`` (one of :attr:`fields`) of each of ``documents`` (indices into the
        ready prefix's documents, in any order), in their stored dtype."""
        if name not in self.fields:
            raise KeyError(f"{self.path}: no document field {name!r} (it has {', '.join(self.fields) or 'none'})")
        documents = np.asarray(documents, np.int64)
        if len(documents) and documents.max() >= self._num_documents:
            self._refresh()
        if len(documents) and not (documents.min() >= 0 and documents.max() < self._num_documents):
            raise IndexError(
                f"{self.path}: documents up to {documents.max()} requested, the ready prefix has {self._num_documents}"
            )
        shards = np.searchsorted(self._doc_starts, documents, side="right") - 1
        reads = []
        for document, index in zip(documents.tolist(), shards.tolist()):
            shard = self._shards[index]
            offsets = self._shard_offsets(index, shard, _field_offsets_key(name))
            local = document - int(self._doc_starts[index])
            lo, hi = int(offsets[local]), int(offsets[local + 1])
            # Offsets count from the shard's first value (offsets[0] is subtracted), as stored.
            reads.append(self._array(index, _field_key(name), shard)[lo:hi].read())
        return [read.result() for read in reads]

    def _read(self, name: str, start: int, stop: int, dtype) -> np.ndarray:
        if stop > self._num_tokens:
            self._refresh()
        if not 0 <= start <= stop <= self._num_tokens:
            raise IndexError(
                f"{self.path}: tokens {start}..{stop} are outside the ready prefix of {self._num_tokens} tokens"
            )
        pieces = []
        first = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        for i in range(max(first, 0), len(self._shards)):
            lo, hi = self._token_starts[i], self._token_starts[i + 1]
            if lo >= stop:
                break
            a, b = max(start, lo) - lo, min(stop, hi) - lo
            if b > a:
                pieces.append(self._array(i, name, self._shards[i])[a:b].read().result())
        return np.concatenate([p.astype(dtype) for p in pieces]) if pieces else np.zeros(0, dtype)

    def _array(self, index: int, name: str, shard: dict) -> ts.TensorStore:
        """Shard ``index``'s array ``name``; a finished shard's is kept open (it never changes)."""
        if (index, name) in self._arrays:
            return self._arrays[(index, name)]
        array = self._storage.open_array(_shard_key(index, name))
        if array is None:
            raise DataError(
                f"{self.path}: {_shard_key(index, name)} is missing although the ledger counts it; remove {self.path} to rebuild it"
            )
        if shard["finished"]:
            self._arrays[(index, name)] = array
        return array

    # -- waiting

    def wait_for(self, *, tokens: int = 0, documents: int = 0) -> None:
        """Block until the ready prefix has ``tokens`` tokens and ``documents`` documents, or the
        cache is complete. Raises the build's error if it failed."""
        if self._build is not None:
            self._wait_on_build(tokens, documents)
        else:
            self._poll(tokens, documents)
        self._version = -1
        self._last_poll = 0.0
        self._refresh()

    def wait_complete(self) -> None:
        """Block until the cache is complete; raises the build's error if it failed."""
        self.wait_for(tokens=1 << 62, documents=1 << 62)

    def _wait_on_build(self, tokens: int, documents: int) -> None:
        build = self._build
        with build.condition:
            while True:
                _, ready_docs, ready_tokens = _ready(build.ledger)
                if build.ledger["complete"] or (ready_tokens >= tokens and ready_docs >= documents):
                    return
                if build.error is not None:
                    raise build.error
                if build.done:
                    raise DataError(f"{self.path}: the cache build stopped before it completed")
                build.condition.wait(timeout=1.0)

    def _poll(self, tokens: int, documents: int) -> None:
        """Wait on a build in another process by reading its ledger."""
        last, changed_at = None, time.monotonic()
        while True:
            ledger = self._storage.read_ledger() or self._ledger
            _, ready_docs, ready_tokens = _ready(ledger)
            if ledger["complete"] or (ready_tokens >= tokens and ready_docs >= documents):
                return
            if ledger != last:
                last, changed_at = ledger, time.monotonic()
            elif time.monotonic() - changed_at > STALE_AFTER:
                raise DataError(
                    f"{self.path}: the cache has not grown for {STALE_AFTER:.0f}s; is the process building it still running?"
                )
            time.sleep(1.0)

    def close(self) -> None:
        """Stop a background build started by :func:`open_cache` (workers terminated, the
        ledger left consistent); the cache resumes from there when opened again."""
        if self._build is not None:
            self._build.stop()

    def __repr__(self) -> str:
        return f"TokenCache({self.path!r}, documents={self._num_documents}, tokens={self._num_tokens}, complete={self._ledger['complete']})"


def read_cache(path: str, *, wait_s: float = 0.0) -> TokenCache:
    """A reader of the cache at ``path`` without building anything (another process builds
    it: :meth:`TokenCache.wait_for` polls its ledger). Waits up to ``wait_s`` seconds for the
    builder to start it, then raises :class:`DataError` if there is still no cache there."""
    storage = _storage(path)
    deadline = time.monotonic() + wait_s
    while (ledger := storage.read_ledger()) is None:
        if time.monotonic() >= deadline:
            waited = f" after waiting {wait_s:.0f}s for the process building it" if wait_s else ""
            raise DataError(f"{path}: no tokenized cache here (no {LEDGER}){waited}")
        time.sleep(0.5)
    return TokenCache(path, storage, ledger)


def open_cache(
    path: str,
    source: DataSourceConfig,
    split: str,
    tokenizer: Tokenizer,
    *,
    enforce_eos: bool,
    skip_bad_data: bool,
    num_workers: int = 1,
    cache_options: CacheOptions | None = None,
    ray=None,
    background: bool = True,
    progress: bool = False,
) -> TokenCache:
    """The cache of ``source``'s ``split`` at ``path``: a complete one is checked and returned;
    otherwise it is built, resuming whatever an earlier build left, in a background thread
    (``background``: the reader is usable at once and grows) or here, with a progress bar if
    ``progress``. ``ray``: a :class:`~levanter_core.trainer.config.RayConfig`; with an
    ``address``, shards are tokenized by Ray tasks instead of ``num_workers`` local processes.
    ``cache_options`` (``data.cache_options``; default its defaults): how the build batches
    and groups its work; the cache it builds is the same whatever they are, so a cache built
    with other options is reused.

    Raises :class:`DataError` if the stored cache was built from other settings or inputs, or
    (when the build is not in the background) if a record is bad and ``skip_bad_data`` is off."""
    if enforce_eos and tokenizer.eos_id is None:
        raise DataError(
            f"data.tokenizer: {tokenizer.name!r} has no end-of-text token to append after each "
            "document; give it one (eos_token in tokenizer_config.json) or set data.enforce_eos: false"
        )
    options = cache_options or CacheOptions()
    storage = _storage(path)
    if not source.shards(split):
        raise DataError(f"the {split} split has no inputs (cache {path})")
    wanted = _new_ledger(split, _identity(tokenizer, source, enforce_eos), tokenizer, source, source.fingerprint(split))
    stored = storage.read_ledger()
    ledger = wanted if stored is None else _reconcile(path, stored, wanted)
    if ledger["complete"]:
        logger.info(
            "reusing the cache %s: %d documents, %d tokens", path, ledger["num_documents"], ledger["num_tokens"]
        )
        return TokenCache(path, storage, ledger)
    job = _Job(
        path=path,
        source=source,
        split=split,
        tokenizer=tokenizer.name,
        tokenizer_fingerprint=tokenizer.fingerprint,
        eos_id=tokenizer.eos_id if enforce_eos else None,
        skip_bad_data=skip_bad_data,
        token_dtype=ledger["token_dtype"],
        batch_size=options.batch_size,
        flush_bytes=options.target_bytes_per_flush,
    )
    build = _Build(
        path,
        storage,
        ledger,
        job,
        num_workers=num_workers,
        num_shard_groups=options.num_shard_groups,
        ray=ray,
        progress=progress,
    )
    connect(ray)  # here, not in the build's thread: Ray's local processes die with the thread that starts them
    if background:
        reader = TokenCache(path, storage, copy.deepcopy(ledger), build)
        build.start()
        return reader
    build.run()
    return TokenCache(path, storage, build.ledger)
