"""The reader: :class:`TokenCache`, the ready prefix of a cache (growing while it is built, here
or by another process), and :func:`read_cache`, which opens a cache without building it."""

from __future__ import annotations

import collections
import time

import numpy as np
import tensorstore as ts

from levanter_core.data.cache.build import _Build
from levanter_core.data.cache.ledger import _ready
from levanter_core.data.cache.storage import LEDGER, _field_key, _field_offsets_key, _shard_key, _storage
from levanter_core.errors import DataError

STALE_AFTER = 600.0
"""A reader waiting on another process's build gives up after this many seconds without progress."""


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
        skipped: collections.Counter[str] = collections.Counter()
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
        assert build is not None  # wait_for waits on the build only when there is one
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
