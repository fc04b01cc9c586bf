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

The package, one job a module: :mod:`~levanter_core.data.cache.storage` reaches a cache's
arrays and ledger; :mod:`~levanter_core.data.cache.ledger` makes the ledger and decides
whether a stored cache can be reused; :mod:`~levanter_core.data.cache.shard` is the workers'
side (tokenizing one shard); :mod:`~levanter_core.data.cache.build` the coordinator;
:mod:`~levanter_core.data.cache.reader` the ready prefix (:class:`TokenCache`). This module
is the public face: :func:`open_cache`, which puts them together, and every name imported
from ``levanter_core.data.cache``.
"""

from __future__ import annotations

import copy
import logging

from levanter_core.data.cache.build import LEDGER_INTERVAL, _Build
from levanter_core.data.cache.ledger import CACHE_FORMAT, MAX_PROBLEMS, _identity, _new_ledger, _reconcile
from levanter_core.data.cache.reader import STALE_AFTER, TokenCache, read_cache
from levanter_core.data.cache.shard import RECORDS_PER_STORE, SKIP_BAD_DATA_HINT, _Job, tokenize_shard
from levanter_core.data.cache.storage import LEDGER, _storage
from levanter_core.data.config import CacheOptions
from levanter_core.data.executor import connect
from levanter_core.data.source import DataSourceConfig
from levanter_core.data.tokenizer import Tokenizer
from levanter_core.errors import DataError

__all__ = [
    "CACHE_FORMAT",
    "LEDGER",
    "LEDGER_INTERVAL",
    "MAX_PROBLEMS",
    "RECORDS_PER_STORE",
    "SKIP_BAD_DATA_HINT",
    "STALE_AFTER",
    "TokenCache",
    "_Job",
    "_storage",
    "cache_is_complete",
    "open_cache",
    "read_cache",
    "tokenize_shard",
]

logger = logging.getLogger(__name__)


def _ledger_to_continue(path: str, source: DataSourceConfig, split: str, tokenizer: Tokenizer, enforce_eos: bool):
    """The storage at ``path`` and the ledger a build of ``source``'s ``split`` continues from:
    the stored one, checked against the configuration, or a new one."""
    storage = _storage(path)
    if not source.shards(split):
        raise DataError(f"the {split} split has no inputs (cache {path})")
    wanted = _new_ledger(split, _identity(tokenizer, source, enforce_eos), tokenizer, source, source.fingerprint(split))
    stored = storage.read_ledger()
    return storage, wanted if stored is None else _reconcile(path, stored, wanted)


def cache_is_complete(
    path: str, source: DataSourceConfig, split: str, tokenizer: Tokenizer, *, enforce_eos: bool
) -> bool:
    """Whether :func:`open_cache` would reuse the cache at ``path`` as it is, building nothing.
    A cache it would refuse (built from other settings) counts as not complete: opening it
    says why."""
    try:
        return bool(_ledger_to_continue(path, source, split, tokenizer, enforce_eos)[1]["complete"])
    except DataError:
        return False


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
    storage, ledger = _ledger_to_continue(path, source, split, tokenizer, enforce_eos)
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
        in_process_below=options.in_process_bytes,
    )
    connect(ray)  # here, not in the build's thread: Ray's local processes die with the thread that starts them
    if background:
        reader = TokenCache(path, storage, copy.deepcopy(ledger), build)
        build.start()
        return reader
    build.run()
    return TokenCache(path, storage, build.ledger)
