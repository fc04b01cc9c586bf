"""The data a run needs, assembled from the ``data:`` section: the tokenizer, a
cache per source and split (built in the background), the training stream and
the validation sets.

This is the one place that connects the pieces; each lives in its own module:
sources (:mod:`.source`), formats (:mod:`.formats`), the cache (:mod:`.cache`),
sequences, shuffling and mixtures (:mod:`.dataset`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping

from levanter_core.data.cache import TokenCache, cache_is_complete, open_cache, read_cache
from levanter_core.data.config import DataConfig
from levanter_core.data.dataset import SequenceDataset, TrainStream, held_out, sequence_dataset
from levanter_core.data.tokenizer import Tokenizer, load_tokenizer
from levanter_core.errors import DataError

logger = logging.getLogger(__name__)

# How long a process that reads another's caches waits for each of them to be started.
FOLLOWER_WAIT_S = 600.0


@dataclasses.dataclass
class LmData:
    """What training reads: the tokenizer, the training stream (``batch(step, size)``),
    and each source's validation sequences by name."""

    tokenizer: Tokenizer
    train: TrainStream
    validation: dict[str, SequenceDataset]
    caches: dict[tuple[str, str], TokenCache]

    def building(self) -> dict[str, TokenCache]:
        """The training caches still being built, by source name."""
        return {name: c for (name, split), c in self.caches.items() if split == "train" and not c.complete}

    def skipped(self) -> dict[str, int]:
        """Bad records skipped so far (``data.skip_bad_data``), per ``source/split``."""
        counts = {}
        for (name, split), cache in self.caches.items():
            n = sum(cache.skipped().values())
            if n:
                counts[f"{name}/{split}"] = n
        return counts

    def close(self) -> None:
        """Stop the background builds (what they finished stays in the cache)."""
        for cache in self.caches.values():
            cache.close()


def _open(
    config: DataConfig,
    name: str,
    split: str,
    tokenizer: Tokenizer,
    *,
    ray,
    background: bool,
    progress: bool,
    build: bool,
):
    source = config.configs[name]
    try:
        if not build:
            return read_cache(config.cache_path(name, split), wait_s=FOLLOWER_WAIT_S)
        return open_cache(
            config.cache_path(name, split),
            source,
            split,
            tokenizer,
            enforce_eos=config.enforce_eos,
            skip_bad_data=config.skip_bad_data,
            num_workers=config.num_workers,
            cache_options=config.cache_options,
            ray=ray,
            background=background,
            progress=progress,
        )
    except DataError as e:
        hint = ""
        if not build:
            hint = (
                " In a multi-process run process 0 tokenizes and the others read its cache: data.cache_dir must be "
                "storage that every process sees (a shared file system, gs://, s3://)."
            )
        raise DataError(f"{config.field_of(name)} ({split}): {e}{hint}") from None


def _held_out_field(count: int | float) -> str:
    return f"data.validation_split_fraction: {count}" if isinstance(count, float) else f"the last {count}"


def needed_caches(config: DataConfig) -> Iterator[tuple[str, str]]:
    """``(source name, split)`` of every cache a run needs, training first."""
    stages = config.weight_stages()
    held = config.held_out()
    for name, source in config.configs.items():
        trained = any(weights[name] > 0 for _, weights in stages)
        if trained or name in held:
            if not source.has_split("train"):
                needs = "data.num_validation_sequences names it" if name in held and not trained else "it is trained on"
                raise DataError(
                    f"{config.field_of(name)}: no training data is configured for source {name!r}, but {needs} "
                    "(set its train_urls)"
                )
            yield name, "train"
    for name, source in config.configs.items():
        if name in held:
            if source.has_split("validation"):
                logger.info(
                    "source %s: validating on the held-out tail of its training data (%s) instead of its "
                    "validation split",
                    name,
                    _held_out_field(held[name]),
                )
        elif source.has_split("validation"):
            yield name, "validation"


def build_lm_data(
    config: DataConfig,
    *,
    seq_len: int,
    seed: int,
    ray=None,
    progress: bool = True,
    build: bool = True,
    initial_batch_size: int | None = None,
    max_epochs: int = 0,
    offsets: Callable[[int], int] | None = None,
    field_lengths: Mapping[str, int] | None = None,
) -> LmData:
    """Start (or reuse) every cache in the background and wire up the datasets.

    Returns at once: reading a batch waits for the data it needs. Problems with the
    configuration or an existing cache (refused, unreadable inputs) raise
    :class:`DataError` here; problems found while tokenizing are raised by the reads.

    ``build`` false: build nothing, read the caches that another process (process 0 of a
    multi-process run) builds, waiting up to ``FOLLOWER_WAIT_S`` for each to be started.

    ``initial_batch_size`` (the batch size at step 0; needed with ``data.max_train_batches``),
    ``max_epochs`` (the top-level ``epoch``) and ``offsets`` (step -> stream position, with a
    batch-size schedule) go to :meth:`TrainStream.from_config`. A source of
    ``data.num_validation_sequences`` validates on the held-out tail of its training data.
    ``field_lengths``: how long each of a ``document`` format's own arrays is in a batch row
    (the objective's :meth:`~levanter_core.objective.Objective.row_lengths`)."""
    tokenizer = load_tokenizer(config.tokenizer)
    caches: dict[tuple[str, str], TokenCache] = {}
    try:
        for name, split in needed_caches(config):
            caches[name, split] = _open(
                config, name, split, tokenizer, ray=ray, background=True, progress=False, build=build
            )
    except BaseException:
        for cache in caches.values():
            cache.close()
        raise
    datasets = {}
    for (name, split), cache in caches.items():
        datasets[name, split] = sequence_dataset(
            cache, seq_len, layout=config.configs[name].format.layout, field_lengths=field_lengths
        )
    train = {name: ds for (name, split), ds in datasets.items() if split == "train"}
    validation = {name: ds for (name, split), ds in datasets.items() if split == "validation"}
    for name, count in config.held_out().items():
        validation[name] = held_out(train[name], name, count, shuffled=config.shuffles_split(count))[1]
    for key, cache in caches.items():
        if not cache.complete:
            builder = "in the background" if build else "by process 0"
            logger.info("%s/%s: the cache is being built %s (%s)", *key, builder, cache.path)
    stream = TrainStream.from_config(
        train, config, seed, initial_batch_size=initial_batch_size, max_epochs=max_epochs, offsets=offsets
    )
    validation = {name: validation[name] for name in config.configs if name in validation}
    return LmData(tokenizer, stream, validation, caches)


def caches_complete(config: DataConfig) -> bool:
    """Whether every cache a run of ``config`` needs is already built, so that nothing is
    tokenized (a multi-process run then starts no Ray cluster). A problem with the data
    (a missing tokenizer, unreadable inputs) answers False: opening the caches reports it."""
    try:
        tokenizer = load_tokenizer(config.tokenizer)
        return all(
            cache_is_complete(
                config.cache_path(name, split),
                config.configs[name],
                split,
                tokenizer,
                enforce_eos=config.enforce_eos,
            )
            for name, split in needed_caches(config)
        )
    except Exception:  # reported where the caches are opened
        return False


def build_caches(config: DataConfig, *, ray=None, progress: bool = True) -> Iterator[tuple[str, str, TokenCache]]:
    """Build every cache of ``config`` now, one after the other (``levanter cache``)."""
    tokenizer = load_tokenizer(config.tokenizer)
    for name, split in needed_caches(config):
        cache = _open(config, name, split, tokenizer, ray=ray, background=False, progress=progress, build=True)
        yield name, split, cache
