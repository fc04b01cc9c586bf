"""``type: hf``: a Hugging Face dataset as a levanter data source.

Three kinds of ``id`` are accepted, the way :func:`datasets.load_dataset` reads them:

* a hub dataset id (``allenai/c4``), fetched through the Hugging Face cache;
* a local directory of data files (``.jsonl``, ``.json``, ``.parquet``, ``.csv``,
  ``.txt``), whose splits come from the file names (``train-*.jsonl``,
  ``validation.jsonl``, ``data/test-*.parquet``...);
* a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``.

The dataset is loaded once per process and kept: the cache builder asks for a split's
shards, then each worker reads its shards' records. A local path is read without any
network access.

Audio columns (a ``datasets.Audio`` feature, at the top level or inside a struct or a list)
are read undecoded: the record holds the file as ``{"bytes": ..., "path": ...}``, and the
audio plugin decodes it (``levanter_audio.manifest.resolve_audio``). ``datasets`` would
decode them with ``torchcodec``, which this plugin neither needs nor installs.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
from collections.abc import Iterator
from types import ModuleType
from typing import Any, ClassVar

from pydantic import Field, PositiveInt

from levanter_core.data.source import SPLITS, DataSourceConfig, Record
from levanter_core.errors import DataError

_ROWS = re.compile(r"^rows\[(\d+):(\d+)\]$")
_STREAM_SHARD = re.compile(r"^shard\[(\d+)/(\d+)\]$")
# Rows converted to Python objects at a time.
_READ_BATCH = 1000


class HfSourceConfig(DataSourceConfig):
    """A Hugging Face dataset: from the hub, a local directory of data files, or a
    directory written by ``save_to_disk``. Records are the dataset's rows as dicts; the
    ``format`` picks the fields it needs (``text_key`` for text). An ``Audio`` column's value
    is the file, undecoded: ``{"bytes": bytes | None, "path": str | None}``."""

    type: str = "hf"
    """The registered type name; ``hf`` for this source (implied by an ``id`` field)."""

    id: str = Field(min_length=1)
    """A hub dataset id (``roneneldan/TinyStories``), a local directory of data files
    (``.jsonl``, ``.json``, ``.parquet``, ``.csv``, ``.txt``; splits are named by the file
    names, e.g. ``train-00000.jsonl``, ``validation.jsonl``), or a directory written by
    ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (a single saved ``Dataset`` is
    the ``train`` split)."""

    name: str | None = None
    """The dataset's configuration (subset) name, e.g. ``en`` for ``allenai/c4``. None: the
    default configuration."""

    train_split: str = "train"
    """The dataset split used for training."""

    validation_split: str | None = "validation"
    """The dataset split used for validation. None: no validation. With the default, a
    dataset without a ``validation`` split simply has no validation; a split named here
    explicitly must exist."""

    stream: bool = False
    """Read the dataset as it is downloaded (an ``IterableDataset``) instead of preparing
    it as Arrow files in the Hugging Face cache first. Shards are then the dataset's own
    (usually its data files)."""

    revision: str | None = None
    """A hub git revision (branch, tag or commit) to read. None: the default branch."""

    data_files: str | tuple[str, ...] | dict[str, str | tuple[str, ...]] | None = None
    """Passed to ``datasets.load_dataset``: the files to read, as a path or pattern, a list
    of them (the ``train`` split), or a mapping from split name to them. Relative paths are
    relative to ``id``."""

    rows_per_shard: PositiveInt = 10_000
    """Rows per shard when not streaming. Shards are the unit of parallel tokenization and
    of the cache's progress, so changing this invalidates a partly built cache."""

    inferred_from: ClassVar[tuple[str, ...]] = ("id",)

    # -- the DataSourceConfig API -----------------------------------------------------------
    def has_split(self, split: str) -> bool:
        name = self._split_name(split)
        if name is None:
            return False
        if split == "train" or "validation_split" in self.model_fields_set:
            return True  # if it does not exist, shards() says so
        return name in self._splits()

    def shards(self, split: str) -> list[str]:
        if self.stream:
            count = self._stream(split).num_shards
            return [f"shard[{i}/{count}]" for i in range(count)]
        rows = len(self._dataset(split))
        return [f"rows[{lo}:{min(lo + self.rows_per_shard, rows)}]" for lo in range(0, rows, self.rows_per_shard)]

    def records(self, split: str, shard: str, start: int = 0) -> Iterator[Record]:
        if self.stream:
            return self._stream_records(split, shard, start)
        return self._row_records(split, shard, start)

    def fingerprint(self, split: str) -> dict:
        identity = {
            "type": "hf",
            "id": self.id,
            "name": self.name,
            "revision": self.revision,
            "data_files": self.model_dump(mode="json")["data_files"],  # as the ledger's JSON reads back
            "split": self._split_name(split),
            "stream": self.stream,
        }
        if self.stream:
            return {**identity, "shards": self._stream_shard_fingerprints(split)}
        # The dataset's own fingerprint covers its data files (paths and modification
        # times) or, for a saved dataset, every transform that produced it.
        dataset_fingerprint = self._dataset(split)._fingerprint
        return {**identity, "shards": dict.fromkeys(self.shards(split), dataset_fingerprint)}

    # -- loading ----------------------------------------------------------------------------
    def _splits(self) -> dict[str, Any]:
        return _loading().load(
            os.path.expanduser(self.id), self.name, self.revision, json.dumps(self.data_files), self.stream
        )

    def _split_name(self, split: str) -> str | None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return self.train_split if split == "train" else self.validation_split

    def _dataset(self, split: str):
        """The loaded ``Dataset`` (or ``IterableDataset``, when streaming a hub or file
        dataset) of ``split``; a missing split is a :class:`DataError` listing those there are."""
        name = self._split_name(split)
        splits = self._splits()
        if name is None or name not in splits:
            field = "train_split" if split == "train" else "validation_split"
            raise DataError(
                f"{field}: dataset {self.id!r} has no split {name!r}; its splits are "
                f"{', '.join(map(repr, splits)) or 'none'}"
            )
        return splits[name]

    def _stream(self, split: str):
        """``split`` as an ``IterableDataset``. A saved dataset streams one shard per Arrow
        file, so its shards match the files its fingerprint lists."""
        ds = self._dataset(split)
        if _loading().is_dataset(ds):
            return ds.to_iterable_dataset(num_shards=max(1, min(len(_arrow_files(ds)), len(ds))))
        return ds

    # -- reading ----------------------------------------------------------------------------
    def _row_records(self, split: str, shard: str, start: int) -> Iterator[Record]:
        ds = self._dataset(split)
        match = _ROWS.match(shard)
        if not match or int(match.group(2)) > len(ds):
            raise DataError(f"{self.id}: no shard {shard!r} in the {split} split (it has {len(ds)} rows)")
        lo, hi = int(match.group(1)), int(match.group(2))
        name = self._split_name(split)
        for begin in range(lo + start, hi, _READ_BATCH):
            for offset, row in enumerate(_rows(ds[begin : min(begin + _READ_BATCH, hi)])):
                yield Record(row, f"{self.id}:{name}:row {begin + offset}")

    def _stream_records(self, split: str, shard: str, start: int) -> Iterator[Record]:
        stream = self._stream(split)
        index, count = self._stream_shard_index(split, shard, stream.num_shards)
        name = self._split_name(split)
        number = 0  # the row being read, for the message if reading fails
        try:
            # Whole batches convert to Python several times faster than row by row.
            for columns in stream.shard(num_shards=count, index=index).iter(batch_size=_READ_BATCH):
                for row in _rows(columns):
                    if number >= start:
                        yield Record(row, f"{self.id}:{name}:{shard}:row {number}")
                    number += 1
        except _loading().READ_ERRORS as e:  # all mean unreadable input
            raise DataError(
                f"{self.id}:{name}:{shard}: cannot read from row {number} on ({type(e).__name__}: {e})"
            ) from e

    def _stream_shard_index(self, split: str, shard: str, count: int) -> tuple[int, int]:
        match = _STREAM_SHARD.match(shard)
        if not match or int(match.group(2)) != count or int(match.group(1)) >= count:
            raise DataError(f"{self.id}: no shard {shard!r} in the streamed {split} split (it has {count} shards)")
        return int(match.group(1)), count

    # -- fingerprints of streamed shards ------------------------------------------------------
    def _stream_shard_fingerprints(self, split: str) -> dict[str, Any]:
        """Each streamed shard's data files with their sizes and modification times (hub
        files: their repository revision). File-based datasets stream one shard per data
        file; when the counts differ, every shard depends on every file."""
        names = self.shards(split)
        ds = self._dataset(split)
        if _loading().is_dataset(ds):
            files = [_describe_file(path) for path in _arrow_files(ds)]
        else:
            files = self._data_files(split)
        if len(files) == len(names):
            return {name: {"files": [file]} for name, file in zip(names, files)}
        digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()
        return {key: {"all_files_sha256": digest} for key in names}

    def _data_files(self, split: str) -> list[list]:
        split_files = _loading().data_files(self.id, self.name, self.revision, self.data_files, self._split_name(split))
        described = []
        for path, origin in split_files:
            local = os.path.isfile(path)
            described.append([path, os.path.getsize(path) if local else None, *origin])
        return described


def _rows(columns: dict[str, list]) -> Iterator[dict]:
    """The rows of a batch given as columns."""
    keys = list(columns)
    for values in zip(*columns.values()):
        yield dict(zip(keys, values))


def _describe_file(path: str) -> list:
    info = os.stat(path)
    return [path, info.st_size, info.st_mtime]


def _arrow_files(ds) -> list[str]:
    return [entry["filename"] for entry in ds.cache_files]


def _loading() -> ModuleType:
    """:mod:`levanter_data_hf.loading`, imported on first use: it imports ``datasets``, which
    a process that only validates a config (or reads other sources) should not pay for."""
    return importlib.import_module("levanter_data_hf.loading")
