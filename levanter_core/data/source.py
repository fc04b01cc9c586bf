"""Where documents come from: the ``data:`` section.

A data source yields the documents of a split (``train`` or ``validation``) as
:class:`Document` s, and describes its inputs with a :meth:`fingerprint` that
keys the tokenized cache. Two sources ship with the core:

* ``type: url`` (the default): JSON-lines and plain-text files named by URLs,
  read through fsspec, with brace expansion (``{1..8}``, ``{a,b}``) and globs;
* ``type: python_stdlib``: the running interpreter's standard library ``.py``
  files, a small code corpus every machine already has.
"""

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
from typing import Iterator, NamedTuple

import fsspec
import zstandard
from pydantic import Field, PositiveInt, field_validator

from levanter_core.config.base import TypedConfig
from levanter_core.errors import DataError

SPLITS = ("train", "validation")


class Document(NamedTuple):
    """One document's text, and where it came from (``file:line``) for messages."""

    text: str
    where: str


class DataSourceConfig(TypedConfig, abc.ABC):
    """Base class of every data source (the ``data:`` section)."""

    cache_dir: str = "cache/"
    """Local directory holding the tokenized caches; each split of each source and
    tokenizer gets its own sub-directory, reused by later runs."""

    tokenizer: str = "byte"
    """``byte`` for the built-in byte-level tokenizer (256 byte ids plus ``<|endoftext|>``),
    or the path of a Hugging Face ``tokenizer.json`` or of a directory containing one."""

    enforce_eos: bool = True
    """Append the end-of-text token after every document, so documents joined into one
    stream stay separated."""

    shuffle: bool = True
    """Shuffle the training sequences, differently each epoch, deterministically from
    ``trainer.seed``. Evaluation always reads in order."""

    @abc.abstractmethod
    def documents(self, split: str) -> Iterator[Document]:
        """The documents of ``split`` (``train`` or ``validation``), in a fixed order.

        Raises :class:`DataError` naming the file and line of anything unreadable."""

    @abc.abstractmethod
    def has_split(self, split: str) -> bool:
        """Whether this source has any input configured for ``split``."""

    @abc.abstractmethod
    def fingerprint(self, split: str) -> dict:
        """A JSON-able description of the inputs of ``split``: it changes whenever the
        documents may have changed (files, sizes, modification times, versions)."""


# -- type: url -----------------------------------------------------------------------------

_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
_FORMATS = (".jsonl", ".txt")
_GLOB_CHARS = re.compile(r"[*?\[]")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


class UrlSourceConfig(DataSourceConfig):
    """JSON-lines (``.jsonl``) and plain-text (``.txt``) files, optionally compressed
    (``.gz``, ``.zst``), named by local paths or fsspec URLs."""

    type: str = "url"
    """The registered type name; ``url`` for this source."""

    train_urls: tuple[str, ...] = ()
    """Training files: paths or URLs, with brace expansion (``data.{1..8}.jsonl.gz``,
    ``{train,extra}.jsonl``) and globs (``shards/*.jsonl.zst``). In ``.jsonl`` files each line
    is a JSON object whose ``text_key`` field is one document; in ``.txt`` files each
    non-blank line is one document."""

    validation_urls: tuple[str, ...] = ()
    """Validation files, written like ``train_urls``. Empty: no validation."""

    text_key: str = Field("text", min_length=1)
    """The field of each JSON line that holds the document's text."""

    @field_validator("train_urls", "validation_urls", mode="before")
    @classmethod
    def _one_url_is_a_list(cls, value):
        return (value,) if isinstance(value, str) else value

    def has_split(self, split: str) -> bool:
        return bool(self._urls(split))

    def fingerprint(self, split: str) -> dict:
        files = []
        for url in self.resolve(split):
            fs, path = fsspec.core.url_to_fs(url)
            info = fs.info(path)
            modified = next((info[k] for k in ("mtime", "LastModified", "updated", "ETag") if k in info), None)
            files.append({"url": url, "size": info.get("size"), "modified": str(modified)})
        return {"type": "url", "text_key": self.text_key, "files": files}

    def documents(self, split: str) -> Iterator[Document]:
        urls = self.resolve(split)
        found = 0
        for url in urls:
            for doc in read_documents(url, self.text_key):
                found += 1
                yield doc
        if not found:
            raise DataError(f"data.{split}_urls: the files hold no documents: {', '.join(urls)}")

    def resolve(self, split: str) -> list[str]:
        """The files of ``split``: every pattern brace-expanded and globbed, in order,
        without duplicates. A pattern that matches nothing is a :class:`DataError`."""
        resolved: dict[str, None] = {}
        for i, pattern in enumerate(self._urls(split)):
            matches = []
            expanded = expand_braces(pattern)
            for url in expanded:
                fs, path = fsspec.core.url_to_fs(url)
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
    depth, parts, begin = 0, [], start + 1
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


def read_documents(url: str, text_key: str = "text") -> Iterator[Document]:
    """The documents of one ``.jsonl`` or ``.txt`` file (optionally compressed)."""
    stem, compression_ext = os.path.splitext(url)
    compression = _COMPRESSIONS.get(compression_ext)
    if compression is None:
        stem = url
    fmt = os.path.splitext(stem)[1]
    if fmt not in _FORMATS:
        raise DataError(
            f"{url}: cannot tell the format from the file name; expected .jsonl or .txt, "
            f"optionally followed by {', '.join(_COMPRESSIONS)}"
        )
    parse = _json_line if fmt == ".jsonl" else _text_line
    try:
        with fsspec.open(url, "rb", compression=compression) as f:
            # zstandard's stream reader cannot iterate lines by itself.
            lines = f if isinstance(f, io.IOBase) else io.BufferedReader(f)
            for number, raw in enumerate(lines, start=1):
                where = f"{url}:{number}"
                text = parse(_decode(raw, url, number), where, text_key)
                if text is not None:
                    yield Document(text, where)
    except FileNotFoundError:
        raise DataError(f"{url}: no such file") from None
    except (OSError, EOFError, zstandard.ZstdError) as e:
        raise DataError(f"{url}: cannot read the file ({type(e).__name__}: {e})") from None


def _decode(raw: bytes, path: str, line: int) -> str:
    """``raw`` as text; ``raw`` starts at ``line`` of ``path`` (for the message)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line += raw.count(b"\n", 0, e.start)
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column})") from None


def _json_line(line: str, where: str, text_key: str) -> str | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}): {_clip(line)}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with a {text_key!r} field, found {_clip(line)}")
    if text_key not in record:
        keys = ", ".join(map(repr, record)) or "none"
        raise DataError(
            f"{where}: no {text_key!r} field (the object's fields: {keys}); "
            "set data.text_key to the field that holds the text"
        )
    text = record[text_key]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_key!r} should be a string, found {type(text).__name__} {_clip(text)}")
    return text


def _text_line(line: str, where: str, text_key: str) -> str | None:
    text = line.rstrip("\r\n")
    return text if text.strip() else None


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

    def fingerprint(self, split: str) -> dict:
        root = _stdlib_root()
        listing = [(p, os.path.getsize(os.path.join(root, p))) for p in self.files(split)]
        digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
        return {
            "type": "python_stdlib",
            "python": f"{sys.implementation.name} {platform.python_version()}",
            "files": len(listing),
            "digest": digest,
        }

    def documents(self, split: str) -> Iterator[Document]:
        root = _stdlib_root()
        for rel in self.files(split):
            path = os.path.join(root, rel)
            with open(path, "rb") as f:
                yield Document(_decode(f.read(), path, 1), path)


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
