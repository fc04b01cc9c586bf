"""Where the data comes from: the sources of the ``data:`` section.

A data source splits each split (``train`` or ``validation``) into *shards* and
yields each shard's :class:`Record` s (text, or a JSON object / table row, with
where it came from); it describes its inputs with a :meth:`~DataSourceConfig.fingerprint`
that keys the tokenized cache. Two sources ship with the core:

* ``type: url`` (the default): ``.jsonl``, ``.json``, ``.parquet`` and ``.txt`` files
  named by paths or fsspec URLs, with brace expansion (``{1..8}``, ``{a,b}``) and globs;
* ``type: python_stdlib``: the running interpreter's standard library ``.py``
  files, a small code corpus every machine already has."""

from __future__ import annotations

import abc
import hashlib
import io
import json
import os
import platform
import re
import sys
import sysconfig
from collections.abc import Iterator
from typing import ClassVar, NamedTuple

import zstandard
from pydantic import Field, PositiveInt, field_validator

from levanter_core.config.base import TypedConfig
from levanter_core.data.formats import DataFormat, TextFormat
from levanter_core.errors import DataError
from levanter_core.fileio import filesystem, open_file, require_filesystem

SPLITS = ("train", "validation")


class Record(NamedTuple):
    """One record of a source: ``value`` is text (a line of a ``.txt`` file, a whole
    file) or a ``dict`` (a JSON object, a table row); ``where`` says where it came from
    (``path:line``) for messages. A record that could not be read has a
    :class:`DataError` as its ``value``, so the reader may raise it or skip and count it."""

    value: str | dict | DataError
    where: str


class DataSourceConfig(TypedConfig, abc.ABC):
    """Base class of every data source: one entry of ``data.configs``, or the ``data:``
    section itself when it names a single source.

    A source's data is a list of *shards* per split (files, usually), each a sequence of
    records. Shards are the unit of parallel tokenization and of the cache's progress
    ledger, so :meth:`shards` and :meth:`records` must give the same answer every time
    for the same inputs."""

    cache_dir: str | None = None
    """This source's own cache directory, in a mixture. Default: ``{data.cache_dir}/{name}``."""

    tags: list[str] | None = None
    """Labels of this source for evaluation: besides each source's own ``eval/<name>/loss``, the
    loss over all validation tokens of the sources sharing a tag is logged as ``eval/<tag>/loss``."""

    format: DataFormat = Field(default_factory=TextFormat)
    """How records become examples: ``type: text`` (default), ``chat`` or ``supervised``, or a
    plugin's format (``audio``: speech with its transcript, from levanter-audio). In a run whose
    model trains with another objective than language modelling, a source without a format gets
    that objective's (``audio`` for Whisper)."""

    inferred_from: ClassVar[tuple[str, ...]] = ()
    """Keys that select this source when a section has no ``type`` (``id`` for Hugging
    Face datasets); a section with none of them is a ``url`` source."""

    _filesystem_installed = field_validator("cache_dir")(require_filesystem)

    @abc.abstractmethod
    def has_split(self, split: str) -> bool:
        """Whether this source has any input configured for ``split``."""

    @abc.abstractmethod
    def shards(self, split: str) -> list[str]:
        """The names of the shards of ``split``, in order (for files: their URLs).
        Raises :class:`DataError` if the configured inputs match nothing."""

    @abc.abstractmethod
    def records(self, split: str, shard: str, start: int = 0) -> Iterator[Record]:
        """The records of one shard, from the ``start``-th on (0-based; records are
        counted the same way every time, so ``start`` resumes a partial read).

        A record that cannot be decoded is yielded with a :class:`DataError` value; a
        shard that cannot be opened at all raises :class:`DataError`."""

    def check_inputs(self, split: str) -> None:
        """Raise :class:`DataError` (naming the field) if the inputs of ``split`` cannot be
        found. Called before a run starts (and by ``levanter train --dry-run``), so it must read
        no records. The default checks nothing: a source whose inputs must be downloaded is
        checked when the run opens it."""

    @abc.abstractmethod
    def fingerprint(self, split: str) -> dict:
        """A JSON-able description of the inputs of ``split``, with a ``shards`` entry
        mapping each shard's name to its own fingerprint (size, modification time,
        version...). It changes whenever the records may have changed."""


# -- type: url -----------------------------------------------------------------------------

_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
_FORMATS = (".jsonl", ".json", ".parquet", ".txt")
_GLOB_CHARS = re.compile(r"[*?\[]")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
# What fsspec's file systems report that changes when a file is rewritten: local and
# memory files, object stores (S3, GCS, Azure) and HTTP servers.
_VERSION_KEYS = (
    "mtime",
    "created",
    "LastModified",
    "last_modified",
    "updated",
    "generation",
    "ETag",
    "etag",
    "Last-Modified",
)
_PARQUET_BATCH_ROWS = 1024


class UrlSourceConfig(DataSourceConfig):
    """Files named by local paths or fsspec URLs (``file://``, ``memory://``, ``http(s)://``,
    and ``s3://``, ``gs://``... when the matching fsspec package is installed), one shard
    per file. The file name's extension says how it is read:

    * ``.jsonl``: one JSON object per non-blank line (``where``: ``path:line``);
    * ``.json``: a JSON array of objects, or an object with exactly one list of objects
      (``where``: ``path:item N``, N counted from 0);
    * ``.parquet``: one record per row, a ``{column: value}`` dict (``where``:
      ``path:row N``, N counted from 0); needs ``pyarrow``;
    * ``.txt``: each non-blank line is one text record (``where``: ``path:line``).

    Any of them but ``.parquet`` (compressed internally) may be compressed: ``.gz``,
    ``.zst``, ``.bz2``, ``.xz`` after the extension (``data.jsonl.zst``)."""

    type: str = "url"
    """The registered type name; ``url`` for this source."""

    train_urls: tuple[str, ...] = ()
    """Training files: paths or URLs, with brace expansion (``data.{1..8}.jsonl.gz``,
    ``{train,extra}.jsonl``) and globs (``shards/*.jsonl.zst``). Which field of a record
    holds the text is the format's business (``format.text_key``, default ``text``)."""

    validation_urls: tuple[str, ...] = ()
    """Validation files, written like ``train_urls``. Empty: no validation."""

    @field_validator("train_urls", "validation_urls", mode="before")
    @classmethod
    def _one_url_is_a_list(cls, value):
        return (value,) if isinstance(value, str) else value

    @field_validator("train_urls", "validation_urls")
    @classmethod
    def _filesystems_installed(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        for url in urls:
            require_filesystem(url)
        return urls

    def has_split(self, split: str) -> bool:
        return bool(self._urls(split))

    def shards(self, split: str) -> list[str]:
        return self.resolve(split)

    def check_inputs(self, split: str) -> None:
        """Every pattern of ``split`` must match a file."""
        self.resolve(split)

    def fingerprint(self, split: str) -> dict:
        shards = {}
        for url in self.resolve(split):
            fs, path = _filesystem(url)
            shards[url] = file_fingerprint(fs.info(path))
        return {"type": "url", "shards": shards}

    def records(self, split: str, shard: str, start: int = 0) -> Iterator[Record]:
        return read_records(shard, start)

    def resolve(self, split: str) -> list[str]:
        """The files of ``split``: every pattern brace-expanded and globbed, in order,
        without duplicates. A pattern that matches nothing is a :class:`DataError`."""
        resolved: dict[str, None] = {}
        for i, pattern in enumerate(self._urls(split)):
            matches = []
            expanded = expand_braces(pattern)
            for url in expanded:
                fs, path = _filesystem(url)
                if _GLOB_CHARS.search(path):
                    matches += [_with_protocol(url, fs, p) for p in sorted(fs.glob(path)) if fs.isfile(p)]
                elif fs.isfile(path):
                    matches.append(url)
            if not matches:
                tried = "" if expanded == [pattern] else f" (tried {', '.join(expanded)})"
                raise DataError(f"data.{split}_urls[{i}]: {pattern!r} matches no file{tried}")
            resolved.update(dict.fromkeys(matches))
        return list(resolved)

    def _urls(self, split: str) -> tuple[str, ...]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return self.train_urls if split == "train" else self.validation_urls


def file_fingerprint(info: dict) -> dict:
    """A file's size and whatever its file system reports that changes when it is
    rewritten (modification time, ETag, generation), from fsspec's ``info``."""
    found = {"size": info.get("size")}
    found.update({key: str(info[key]) for key in _VERSION_KEYS if info.get(key) is not None})
    return found


def _filesystem(url: str):
    """fsspec's file system and path for ``url``; a protocol whose package is missing
    (``http`` needs ``aiohttp``, ``s3`` needs ``s3fs``...) is a :class:`DataError`."""
    try:
        return filesystem(url)
    except ImportError as e:
        raise DataError(f"{url}: cannot read this kind of URL here ({e}); install the package it names") from None
    except ValueError as e:
        raise DataError(f"{url}: not a URL fsspec can read ({e})") from None


def _with_protocol(pattern: str, fs, path: str) -> str:
    # Globbing strips the protocol; keep local paths as the user wrote them.
    return fs.unstrip_protocol(path) if "://" in pattern else path


def expand_braces(pattern: str) -> list[str]:
    """Shell-style brace expansion: ``a{1..3}`` -> ``a1 a2 a3`` (zero-padded when the
    bounds are, as in ``{01..10}``), ``{x,y}z`` -> ``xz yz``; groups may nest. A group
    that is neither (``{x}``) is kept literally."""
    start = pattern.find("{")
    while start != -1:
        end, parts = _brace_group(pattern, start)
        if end is not None:
            alternatives = parts if len(parts) > 1 else _brace_range(parts[0])
            if alternatives is not None:
                head, tail = pattern[:start], pattern[end + 1 :]
                return [out for alt in alternatives for out in expand_braces(head + alt + tail)]
        start = pattern.find("{", start + 1)
    return [pattern]


def _brace_group(pattern: str, start: int) -> tuple[int | None, list[str]]:
    """The index of the ``}`` closing the ``{`` at ``start``, and the group's top-level
    comma-separated parts."""
    depth, begin = 0, start + 1
    parts: list[str] = []
    for i in range(start, len(pattern)):
        c = pattern[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i, parts + [pattern[begin:i]]
        elif c == "," and depth == 1:
            parts.append(pattern[begin:i])
            begin = i + 1
    return None, []


def _brace_range(body: str) -> list[str] | None:
    m = _RANGE.match(body)
    if not m:
        return None
    lo, hi = int(m.group(1)), int(m.group(2))
    padded = any(len(s.lstrip("-")) > 1 and s.lstrip("-").startswith("0") for s in m.groups())
    width = max(len(s) for s in m.groups()) if padded else 0
    step = 1 if hi >= lo else -1
    return [str(n).zfill(width) for n in range(lo, hi + step, step)]


def read_records(url: str, start: int = 0) -> Iterator[Record]:
    """The records of one file, from the ``start``-th on (see :class:`UrlSourceConfig`
    for the file kinds). Records before ``start`` are skipped without being parsed
    (whole row groups at once for Parquet). A file that cannot be opened or read raises
    :class:`DataError`; a record that cannot be decoded is yielded with one as its value."""
    kind, compression = file_kind(url)
    fs, path = _filesystem(url)
    if not fs.isfile(path):
        raise DataError(f"{url}: no such file")
    readers = {".jsonl": _line_records, ".txt": _line_records, ".json": _json_records, ".parquet": _parquet_records}
    try:
        yield from readers[kind](url, kind, compression, start)
    except FileNotFoundError:
        raise DataError(f"{url}: no such file") from None
    except (OSError, EOFError, zstandard.ZstdError) as e:
        raise DataError(f"{url}: cannot read the file ({type(e).__name__}: {e})") from None


def file_kind(url: str) -> tuple[str, str | None]:
    """The file's format extension (``.jsonl``, ``.json``, ``.parquet``, ``.txt``) and
    fsspec compression name (or None), from its name."""
    stem, compression_ext = os.path.splitext(url)
    compression = _COMPRESSIONS.get(compression_ext)
    if compression is None:
        stem = url
    kind = os.path.splitext(stem)[1]
    if kind not in _FORMATS:
        raise DataError(
            f"{url}: cannot tell the format from the file name; expected {', '.join(_FORMATS)}, "
            f"optionally followed by {', '.join(_COMPRESSIONS)}"
        )
    if kind == ".parquet" and compression:
        raise DataError(f"{url}: Parquet files are compressed internally; use the plain .parquet file")
    return kind, compression


def _line_records(url: str, kind: str, compression: str | None, start: int) -> Iterator[Record]:
    parse = _json_line if kind == ".jsonl" else _text_line
    with open_file(url, "rb", compression=compression) as f:
        # zstandard's stream reader cannot iterate lines by itself.
        lines = f if isinstance(f, io.IOBase) else io.BufferedReader(f)
        index = 0
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            index += 1
            if index <= start:
                continue
            where = f"{url}:{number}"
            try:
                yield Record(parse(_decode(raw, url, number), where), where)
            except DataError as e:
                yield Record(e, where)


def _json_records(url: str, kind: str, compression: str | None, start: int) -> Iterator[Record]:
    """A ``.json`` file's objects. The whole file is parsed (JSON has no cheaper way to
    find the ``start``-th item); a file that does not parse, or holds no list of objects,
    is one bad record, so that ``skip_bad_data`` can pass over it."""
    with open_file(url, "rb", compression=compression) as f:
        raw = f.read()
    items, bad = _json_items(url, raw)
    if bad is not None:
        yield from [bad][start:]
        return
    for n in range(start, len(items)):
        where = f"{url}:item {n}"
        if isinstance(items[n], dict):
            yield Record(items[n], where)
        else:
            yield Record(DataError(f"{where}: expected a JSON object, found {_clip(json.dumps(items[n]))}"), where)


def _json_items(url: str, raw: bytes) -> tuple[list, Record | None]:
    """The list of items of a ``.json`` file, or a bad :class:`Record` saying why there is none."""
    try:
        document = json.loads(_decode(raw, url, 1))
    except DataError as e:
        return [], Record(e, url)
    except json.JSONDecodeError as e:
        where = f"{url}:{e.lineno}"
        return [], Record(DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})"), where)
    if isinstance(document, list):
        return document, None
    lists = [key for key, value in document.items() if isinstance(value, list)] if isinstance(document, dict) else []
    if len(lists) == 1:
        return document[lists[0]], None
    found = (
        f"an object with keys {', '.join(map(repr, document)) or 'none'}"
        if isinstance(document, dict)
        else _clip(document)
    )
    message = f"{url}: expected a JSON array of objects, or an object with exactly one list of objects; found {found}"
    return [], Record(DataError(message), url)


def _parquet_records(url: str, kind: str, compression: str | None, start: int) -> Iterator[Record]:
    """A Parquet file's rows as ``{column: value}`` dicts, read a batch at a time; the
    row groups wholly before ``start`` are not read at all."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{url}: reading Parquet files needs pyarrow (pip install pyarrow)") from None
    with open_file(url, "rb") as f:
        try:
            table = pq.ParquetFile(f)
            counts = [table.metadata.row_group(g).num_rows for g in range(table.metadata.num_row_groups)]
            first_group, row = 0, 0
            while first_group < len(counts) and row + counts[first_group] <= start:
                row += counts[first_group]
                first_group += 1
            if first_group == len(counts):
                return
            groups = list(range(first_group, len(counts)))
            for batch in table.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=groups):
                rows = batch.to_pylist()
                skip = min(max(start - row, 0), len(rows))
                for n, values in enumerate(rows[skip:], start=row + skip):
                    yield Record(values, f"{url}:row {n}")
                row += len(rows)
        except pa.ArrowException as e:
            raise DataError(f"{url}: not a readable Parquet file ({e})") from None


def _decode(raw: bytes, path: str, line: int) -> str:
    """``raw`` as text; ``raw`` starts at ``line`` of ``path`` (for the message)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line += raw.count(b"\n", 0, e.start)
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column})") from None


def _json_line(line: str, where: str) -> dict:
    line = line.rstrip("\r\n")  # so that an unterminated string is reported as such
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}): {_clip(line)}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, found {_clip(line)}")
    return record


def _text_line(line: str, where: str) -> str:
    return line.rstrip("\r\n")


def _clip(value, limit: int = 80) -> str:
    text = value.strip() if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- type: python_stdlib -------------------------------------------------------------------

# Directories of the standard library that are not its own source: test suites, installed
# third-party packages, build configuration.
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


class PythonStdlibSourceConfig(DataSourceConfig):
    """The running Python's standard library ``.py`` files (about 12 MB of code),
    without test suites or installed packages; one document per file."""

    type: str = "python_stdlib"
    """The registered type name; ``python_stdlib`` for this source."""

    validation_fraction: float = Field(0.05, ge=0, lt=1)
    """Share of files held out for validation, chosen by a hash of each file's path, so
    the split is the same on every run and machine with the same Python. 0: no validation."""

    max_files: PositiveInt | None = None
    """Use only the first ``max_files`` files (in path order) of each split; for quick tests."""

    def has_split(self, split: str) -> bool:
        return split == "train" or (split == "validation" and self.validation_fraction > 0)

    def files(self, split: str) -> list[str]:
        """Paths, relative to the standard library directory, of the files of ``split``."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        want_validation = split == "validation"
        chosen = [p for p in _stdlib_files() if (_stable_fraction(p) < self.validation_fraction) == want_validation]
        return chosen[: self.max_files]

    def shards(self, split: str) -> list[str]:
        files = self.files(split)
        return [f"files[{lo}:{lo + len(group)}]" for lo, group in _groups(files)]

    def fingerprint(self, split: str) -> dict:
        root = _stdlib_root()
        shards = {}
        for lo, group in _groups(self.files(split)):
            listing = [(p, os.path.getsize(os.path.join(root, p))) for p in group]
            shards[f"files[{lo}:{lo + len(group)}]"] = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
        return {
            "type": "python_stdlib",
            "python": f"{sys.implementation.name} {platform.python_version()}",
            "shards": shards,
        }

    def records(self, split: str, shard: str, start: int = 0) -> Iterator[Record]:
        root = _stdlib_root()
        groups = {f"files[{lo}:{lo + len(group)}]": group for lo, group in _groups(self.files(split))}
        if shard not in groups:
            raise DataError(f"python_stdlib: no shard {shard!r} in the {split} split")
        for rel in groups[shard][start:]:
            path = os.path.join(root, rel)
            with open(path, "rb") as f:
                raw = f.read()
            try:
                yield Record(_decode(raw, path, 1), path)
            except DataError as e:
                yield Record(e, path)


_FILES_PER_SHARD = 32


def _groups(files: list[str]):
    for lo in range(0, len(files), _FILES_PER_SHARD):
        yield lo, files[lo : lo + _FILES_PER_SHARD]


def _stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _stdlib_files() -> list[str]:
    root = _stdlib_root()
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-")]
        rel_dir = os.path.relpath(directory, root)
        for name in names:
            # _sysconfigdata_* describes how this particular interpreter was built.
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(os.path.normpath(os.path.join(rel_dir, name)))
    return sorted(found)


def _stable_fraction(rel_path: str) -> float:
    """A number in [0, 1) fixed by the path alone (not Python's salted ``hash``)."""
    digest = hashlib.sha256(rel_path.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64
