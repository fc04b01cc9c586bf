"""The workers' side: tokenizing one shard of a cache from its resume point, in a worker process
or a Ray task (:mod:`levanter_core.data.executor` runs them). What a worker encodes is stored in
the shard's arrays before it is reported; a worker never writes the ledger."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from levanter_core.data.cache.ledger import MAX_PROBLEMS
from levanter_core.data.cache.storage import _field_key, _field_offsets_key, _shard_key, _storage
from levanter_core.data.executor import Progress, ShardTask
from levanter_core.data.source import DataSourceConfig, Record
from levanter_core.data.tokenizer import Tokenizer, load_tokenizer
from levanter_core.errors import DataError

SKIP_BAD_DATA_HINT = "set data.skip_bad_data: true to skip such records and count them"
"""What a bad record stops the build with (a training config's setting)."""


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


class _ShardWriter:
    """Stores a shard's documents in its arrays, from given positions on."""

    def __init__(self, storage, index: int, token_dtype: np.dtype, packed: bool, fields: dict[str, str]):
        self._storage = storage
        self._index = index
        self._dtype = token_dtype
        self._fields = {name: np.dtype(dtype) for name, dtype in fields.items()}
        names: dict[str, npt.DTypeLike] = {"tokens": token_dtype, "offsets": np.int64}
        if packed:
            names["target_mask"] = np.uint8
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
