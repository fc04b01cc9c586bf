"""The tokenized cache: each split's documents tokenized once, kept on disk, reused.

Layout, for each split of each (source, tokenizer) pair::

    {cache_dir}/{split}-{key}/
        tokens/       zarr array: every document's ids, concatenated (uint16 or int32)
        offsets/      zarr array (int64, num_documents + 1): where each document starts
        ledger.json   what the cache holds; written last

``key`` hashes the source's fingerprint, the tokenizer's fingerprint and
``enforce_eos`` (not the sequence length: sequences are cut at read time).
A cache is built in a sibling directory and renamed into place when complete,
so a directory without ``ledger.json`` is never used, and a build that is
killed never damages a good cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from typing import Iterable, Iterator

import numpy as np
import tensorstore as ts
from tqdm import tqdm

from levanter_core.data.source import DataSourceConfig, Document
from levanter_core.data.tokenizer import Tokenizer
from levanter_core.errors import DataError

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
LEDGER = "ledger.json"
DOCS_PER_BATCH = 1000
"""Documents tokenized together; bounds memory and keeps the tokenizer busy."""
_CHUNK = 1 << 20  # elements per zarr chunk


@dataclasses.dataclass(frozen=True)
class TokenCache:
    """A complete cache of one split."""

    path: str
    ledger: dict

    @property
    def num_documents(self) -> int:
        return self.ledger["num_documents"]

    @property
    def num_tokens(self) -> int:
        return self.ledger["num_tokens"]

    def tokens(self) -> np.ndarray:
        """All token ids, concatenated, read into memory (in the stored dtype)."""
        return _open(os.path.join(self.path, "tokens")).read().result()

    def document_offsets(self) -> np.ndarray:
        """``num_documents + 1`` offsets into :meth:`tokens`; document ``i`` is
        ``tokens[offsets[i]:offsets[i + 1]]``."""
        return _open(os.path.join(self.path, "offsets")).read().result()


def _cache_path(cache_dir: str, split: str, fingerprint: dict, tokenizer: Tokenizer, enforce_eos: bool) -> str:
    identity = {
        "format": CACHE_FORMAT,
        "source": fingerprint,
        "tokenizer": tokenizer.fingerprint,
        "enforce_eos": enforce_eos,
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"{split}-{key}")


def load_cache(path: str) -> TokenCache | None:
    """The cache at ``path`` if it is complete, else None."""
    try:
        with open(os.path.join(path, LEDGER)) as f:
            return TokenCache(path, json.load(f))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def build_or_load_cache(
    config: DataSourceConfig, split: str, tokenizer: Tokenizer, *, progress: bool = True
) -> TokenCache:
    """The cache of ``split``: reused if a complete one exists, else built now."""
    fingerprint = config.fingerprint(split)
    path = _cache_path(_local_dir(config.cache_dir), split, fingerprint, tokenizer, config.enforce_eos)
    cache = load_cache(path)
    if cache is not None:
        logger.info(
            "reusing the %s cache %s: %d documents, %d tokens", split, path, cache.num_documents, cache.num_tokens
        )
        return cache
    if config.enforce_eos and tokenizer.eos_id is None:
        raise DataError(
            f"data.tokenizer: {tokenizer.name!r} has no end-of-text token to append after each "
            "document; give it one (eos_token in tokenizer_config.json) or set data.enforce_eos: false"
        )
    return _build(config, split, fingerprint, tokenizer, path, progress)


def _build(
    config: DataSourceConfig, split: str, fingerprint: dict, tokenizer: Tokenizer, path: str, progress: bool
) -> TokenCache:
    parent, final_name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    _remove_abandoned_builds(parent, final_name)
    tmp = os.path.join(parent, f"{final_name}.building.{socket.gethostname()}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    eos = tokenizer.eos_id if config.enforce_eos else None
    started = time.monotonic()
    try:
        tokens = _AppendArray(os.path.join(tmp, "tokens"), dtype)
        offsets = _AppendArray(os.path.join(tmp, "offsets"), np.int64)
        offsets.append(np.zeros(1, np.int64))
        num_docs = num_tokens = 0
        with tqdm(desc=f"tokenizing {split}", unit="doc", disable=not progress) as bar:
            for ids in _tokenize(config.documents(split), tokenizer, eos):
                lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids))
                tokens.append(np.concatenate(ids).astype(dtype, copy=False))
                offsets.append(num_tokens + np.cumsum(lengths))
                num_docs += len(ids)
                num_tokens += int(lengths.sum())
                bar.update(len(ids))
                rate = num_tokens / max(time.monotonic() - started, 1e-9)
                bar.set_postfix(tokens=num_tokens, tokens_per_s=f"{rate:.3g}")
        if num_docs == 0:
            raise DataError(f"data ({config.type}): the {split} split has no documents")
        tokens.close()
        offsets.close()
        ledger = {
            "format": CACHE_FORMAT,
            "split": split,
            "num_documents": num_docs,
            "num_tokens": num_tokens,
            "token_dtype": np.dtype(dtype).name,
            "enforce_eos": config.enforce_eos,
            "tokenizer": {
                "name": tokenizer.name,
                "fingerprint": tokenizer.fingerprint,
                "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id,
            },
            "source": fingerprint,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _write_ledger(tmp, ledger)
        _move_into_place(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.monotonic() - started
    logger.info(
        "built the %s cache %s: %d documents, %d tokens in %.1fs (%.3g tokens/s)",
        split,
        path,
        num_docs,
        num_tokens,
        seconds,
        num_tokens / max(seconds, 1e-9),
    )
    return TokenCache(path, ledger)


def _tokenize(documents: Iterable[Document], tokenizer: Tokenizer, eos: int | None) -> Iterator[list[np.ndarray]]:
    """Token ids of the documents, ``DOCS_PER_BATCH`` at a time, each ending in ``eos``
    (unless ``eos`` is None or the tokenizer already put it there)."""
    batch: list[str] = []
    for doc in documents:
        if not isinstance(doc.text, str):
            raise DataError(f"{doc.where}: a document should be text, found {type(doc.text).__name__}")
        batch.append(doc.text)
        if len(batch) == DOCS_PER_BATCH:
            yield _encode(batch, tokenizer, eos)
            batch = []
    if batch:
        yield _encode(batch, tokenizer, eos)


def _encode(texts: list[str], tokenizer: Tokenizer, eos: int | None) -> list[np.ndarray]:
    ids = tokenizer.encode_batch(texts)
    if eos is None:
        return ids
    eos_array = np.array([eos], np.int32)
    return [x if len(x) and x[-1] == eos else np.concatenate([x, eos_array]) for x in ids]


class _AppendArray:
    """A growing 1-D zarr array, written a whole number of chunks at a time."""

    def __init__(self, path: str, dtype):
        self._array = ts.open(
            {"driver": "zarr", "kvstore": {"driver": "file", "path": path}},
            create=True,
            dtype=np.dtype(dtype),
            shape=[0],
            chunk_layout=ts.ChunkLayout(chunk_shape=[_CHUNK]),
        ).result()
        self._dtype = dtype
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self._written = 0

    def append(self, values: np.ndarray) -> None:
        self._pending.append(values.astype(self._dtype, copy=False))
        self._pending_size += len(values)
        if self._pending_size >= _CHUNK:
            self._flush(whole_chunks_only=True)

    def close(self) -> None:
        self._flush(whole_chunks_only=False)

    def _flush(self, whole_chunks_only: bool) -> None:
        data = np.concatenate(self._pending) if self._pending else np.zeros(0, self._dtype)
        n = len(data) // _CHUNK * _CHUNK if whole_chunks_only else len(data)
        end = self._written + n
        self._array = self._array.resize(exclusive_max=[end]).result()
        self._array[self._written : end].write(data[:n]).result()
        self._written = end
        self._pending = [data[n:]]
        self._pending_size = len(data) - n


def _open(path: str) -> ts.TensorStore:
    return ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": path}}, open=True).result()


def _write_ledger(directory: str, ledger: dict) -> None:
    path = os.path.join(directory, LEDGER)
    with open(path, "w") as f:
        json.dump(ledger, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _move_into_place(tmp: str, path: str) -> None:
    if os.path.exists(path):
        if load_cache(path) is not None:
            return  # another process finished the same cache first; keep theirs
        logger.warning("removing the incomplete cache %s (it has no %s)", path, LEDGER)
        shutil.rmtree(path)
    os.rename(tmp, path)


def _remove_abandoned_builds(parent: str, final_name: str) -> None:
    """Delete earlier builds of the same cache, on this machine, whose process is gone."""
    prefix = f"{final_name}.building.{socket.gethostname()}."
    for name in os.listdir(parent):
        pid = name[len(prefix) :]
        if name.startswith(prefix) and pid.isdigit() and not _process_alive(int(pid)):
            logger.warning("removing %s, left by a build that did not finish", os.path.join(parent, name))
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _local_dir(cache_dir: str) -> str:
    if cache_dir.startswith("file://"):
        return cache_dir.removeprefix("file://")
    if "://" in cache_dir:
        raise DataError(
            f"data.cache_dir: {cache_dir!r} is a remote URL; the tokenized cache is written to a "
            "local directory for now (give a local path)"
        )
    return cache_dir
