"""Sequences of ``seq_len`` tokens read from a tokenized cache, and the batches training reads.

Three kinds of sequence dataset sit over one cache (the same cache serves any ``seq_len``),
one per format layout (:attr:`~levanter_core.data.formats.FormatConfig.layout`):

* :class:`TextSequences` (``stream``): the token stream of all documents, cut into
  consecutive ``seq_len`` windows (the tail that does not fill one is dropped);
* :class:`PackedSequences` (``packed``: chat, supervised): whole examples packed greedily, in
  order, into ``seq_len`` slots, with segment ids so attention does not cross examples and a
  loss mask from the examples' target masks;
* :class:`DocumentExamples` (``document``: audio with its transcript): each document one row,
  its tokens and its format's own arrays (``Batch.fields``) padded or cut to fixed lengths.

:class:`TrainStream` turns named datasets into the training stream: each source a stream of
passes (a keyed permutation, an era shuffle, or in order; possibly cut to a part of the
source, see ``data.max_train_batches`` and simulated epoching), mixed block-wise by
``train_weights``. The batch at step N holds stream positions ``N*B .. N*B+B-1`` (or from
the position a batch-size schedule gives) and is computed directly from (seed, data config,
position), never by reading through earlier steps; it does not depend on how fast the cache
was built, because a sequence is only read once it is final, and reading one that is not
waits for the cache. The stream is endless unless ``data.stop_strategy`` or ``epoch`` ends
it; a batch past its end raises :class:`~levanter_core.errors.DataExhausted`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from levanter_core.data.permutation import Permutation, derive_key
from levanter_core.errors import DataError, DataExhausted

logger = logging.getLogger(__name__)

TOO_SHORT_HINT = "add data or shorten the sequences"
"""What a cache too short for one sequence is told to do."""

if TYPE_CHECKING:
    from levanter_core.data.cache import TokenCache
    from levanter_core.data.config import DataConfig


@dataclasses.dataclass(frozen=True)
class Batch:
    """Sequences for one step.

    ``tokens``: int32 ``[B, S]``. ``loss_mask``: float32 ``[B, S]``, the weight of predicting
    ``tokens[b, t + 1]`` from position ``t``; None means every position but the last.
    ``segment_ids``: int32 ``[B, S]``, 1, 2, 3... for the examples packed in a row and 0 for
    padding; None for plain text streams (one causal sequence per row).
    ``fields``: a format's own arrays, ``[B, length]`` each, by name (``document`` layouts:
    an utterance's audio samples, say); None for text."""

    tokens: np.ndarray
    loss_mask: np.ndarray | None = None
    segment_ids: np.ndarray | None = None
    fields: dict[str, np.ndarray] | None = None


class SequenceDataset:
    """Sequences of ``seq_len`` tokens over one cache, numbered in stored order.

    A sequence is *available* once it is final: it will read the same whatever the cache
    adds later. ``final_length()`` is known once the cache is complete."""

    packed = False
    """Whether rows come with segment ids and loss masks (examples packed into a row)."""

    field_shapes: dict[str, tuple[int, np.dtype]] = {}
    """The format's own arrays each row holds (:attr:`Batch.fields`): name -> (length, dtype)."""

    def __init__(self, cache: TokenCache, seq_len: int):
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.cache = cache
        self.seq_len = seq_len

    def available(self) -> int:
        """How many sequences are final now."""
        raise NotImplementedError

    def final_length(self) -> int | None:
        """The number of sequences once the cache is complete, else None. Raises
        :class:`DataError` when the complete cache holds not even one sequence."""
        raise NotImplementedError

    def wait_for(self, n: int) -> None:
        """Block until ``n`` sequences are available or the cache is complete (then
        fewer may exist). Raises the cache build's error."""
        raise NotImplementedError

    def wait_complete(self) -> int:
        """Block until the cache is complete; the number of sequences."""
        self.cache.wait_complete()
        length = self.final_length()
        assert length is not None, f"{self.cache.path}: wait_complete returned before the cache was complete"
        return length

    def rows(self, indices: np.ndarray) -> Batch:
        """The available sequences ``indices`` as a :class:`Batch` (one row each)."""
        raise NotImplementedError

    def _check_available(self, indices: np.ndarray, available: int) -> None:
        if len(indices) and (indices.min() < 0 or indices.max() >= available):
            raise IndexError(f"{self.cache.path}: sequence {indices.max()} requested but {available} are available")

    def _too_short(self, what: str) -> DataError:
        return DataError(
            f"{self.cache.path}: the complete cache holds {what}, not one sequence of seq_len {self.seq_len}; "
            f"{TOO_SHORT_HINT}"
        )


class TextSequences(SequenceDataset):
    """The token stream cut into consecutive ``seq_len`` windows; the tail is dropped."""

    def available(self) -> int:
        return self.cache.num_tokens // self.seq_len

    def final_length(self) -> int | None:
        if not self.cache.complete:
            return None
        length = self.cache.num_tokens // self.seq_len
        if length == 0:
            raise self._too_short(f"{self.cache.num_tokens} tokens")
        return length

    def wait_for(self, n: int) -> None:
        self.cache.wait_for(tokens=n * self.seq_len)

    def rows(self, indices: np.ndarray) -> Batch:
        indices = np.asarray(indices, np.int64)
        self._check_available(indices, self.available())
        S = self.seq_len
        out = np.empty((len(indices), S), np.int32)
        # One read per run of consecutive sequences (in-order reading is one read per batch).
        breaks = np.flatnonzero(np.diff(indices) != 1) + 1
        for run in np.split(np.arange(len(indices)), breaks):
            if len(run):
                first = int(indices[run[0]])
                out[run] = self.cache.tokens(first * S, (first + len(run)) * S).reshape(len(run), S)
        return Batch(out)


class PackedSequences(SequenceDataset):
    """Whole examples packed greedily, in stored order, into ``seq_len`` slots.

    A pack takes examples while they fit; an example longer than ``seq_len`` is truncated
    to it (see :attr:`truncated`) and fills a pack. A pack is final once the example after
    it is known not to fit, or the cache is complete, so packing never depends on how far
    the cache had got when it was computed. Packs are computed incrementally as the cache
    grows (a Python step per pack, numpy within)."""

    packed = True

    def __init__(self, cache: TokenCache, seq_len: int):
        super().__init__(cache, seq_len)
        self._lock = threading.Lock()
        # bounds[k] is the first example of pack k; bounds[-1] the first example not yet
        # in a final pack. offsets: the cache's document offsets when last refreshed.
        self._bounds = np.zeros(1, np.int64)
        self._offsets = np.zeros(1, np.int64)
        self._seen_documents = 0
        self._done = False
        self._truncated = 0

    @property
    def truncated(self) -> int:
        """Examples in final packs that were longer than ``seq_len`` and were cut to it."""
        return self._truncated

    def available(self) -> int:
        self._refresh()
        return len(self._bounds) - 1

    def final_length(self) -> int | None:
        self._refresh()
        if not self._done:
            return None
        if len(self._bounds) == 1:
            raise self._too_short("no examples")
        return len(self._bounds) - 1

    def wait_for(self, n: int) -> None:
        while True:
            self._refresh()
            have = len(self._bounds) - 1
            if have >= n or self._done:
                return
            # Each further pack needs at least one more example, and the example after it.
            cursor = int(self._bounds[-1])
            self.cache.wait_for(documents=max(self._seen_documents + 1, cursor + (n - have) + 1))

    def _refresh(self) -> None:
        with self._lock:
            if self._done:
                return
            complete = self.cache.complete  # read first: offsets read after it are then final
            if not complete and self.cache.num_documents == self._seen_documents:
                return
            offsets = np.asarray(self.cache.document_offsets(), np.int64)
            cursor = int(self._bounds[-1])
            starts = self._pack_starts(np.diff(offsets[cursor:]), complete)
            new_cursor = cursor + starts[-1]
            self._truncated += int(np.count_nonzero(np.diff(offsets[cursor : new_cursor + 1]) > self.seq_len))
            self._offsets = offsets
            self._bounds = np.concatenate([self._bounds[:-1], cursor + np.asarray(starts, np.int64)])
            self._seen_documents = len(offsets) - 1
            self._done = complete

    def _pack_starts(self, lengths: np.ndarray, complete: bool) -> list[int]:
        """Start of each final pack among examples of ``lengths`` (relative to the first), and
        finally the start of the first example not in a final pack."""
        clipped = np.minimum(lengths, self.seq_len)
        ends = np.concatenate([[0], np.cumsum(clipped)])
        # A pack starting at example a holds examples a .. following[a] - 1 (all that fit).
        following = (np.searchsorted(ends, ends[:-1] + self.seq_len, side="right") - 1).tolist()
        starts, a, known = [0], 0, len(lengths)
        while a < known:
            b = following[a]
            if b == known and not complete:  # the next example could still fit
                break
            starts.append(b)
            a = b
        return starts

    def rows(self, indices: np.ndarray) -> Batch:
        # bounds before offsets: _refresh replaces offsets first, so these offsets cover these packs.
        bounds, offsets, S = self._bounds, self._offsets, self.seq_len
        indices = np.asarray(indices, np.int64)
        self._check_available(indices, len(bounds) - 1)
        tokens = np.zeros((len(indices), S), np.int32)
        targets = np.ones((len(indices), S), np.float32)
        segments = np.zeros((len(indices), S), np.int32)
        positions = np.arange(S)
        for row, k in enumerate(indices):
            first, last = int(bounds[k]), int(bounds[k + 1])
            start = int(offsets[first])
            used = min(int(offsets[last]) - start, S)
            tokens[row, :used] = self.cache.tokens(start, start + used)
            mask = self.cache.target_mask(start, start + used)
            if mask is not None:
                targets[row, :used] = mask
            # Example i of the pack covers [offsets[first + i], offsets[first + i + 1]) - start.
            segments[row, :used] = np.searchsorted(offsets[first : last + 1] - start, positions[:used], side="right")
        return Batch(tokens, _packed_loss_mask(targets, segments), segments)


def _packed_loss_mask(targets: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """``loss_mask[t] = targets[t + 1]`` where ``t + 1`` is in the same example as ``t``, else 0."""
    same = (segments[:, :-1] == segments[:, 1:]) & (segments[:, :-1] > 0)
    loss = np.zeros_like(targets)
    loss[:, :-1] = np.where(same, targets[:, 1:], 0.0)
    return loss


class DocumentExamples(SequenceDataset):
    """Each document of the cache one row, in stored order: its tokens, cut to ``seq_len`` or
    padded with zeros, with a loss mask that scores each next token of the document (and
    nothing past it); and each of the cache's document fields (an utterance's audio samples)
    cut to, or padded with zeros to, its length in ``field_lengths``.

    A document is final as soon as it is stored, so rows are available as the cache grows.
    :attr:`truncated` counts the rows read so far whose tokens or fields were cut."""

    packed = True

    def __init__(self, cache: TokenCache, seq_len: int, field_lengths: Mapping[str, int] | None = None):
        super().__init__(cache, seq_len)
        stored = cache.fields
        lengths = dict(field_lengths or {})
        missing = sorted(set(stored) - set(lengths))
        if missing:
            raise DataError(
                f"{cache.path}: the cache holds {', '.join(missing)} with each document, but the training objective "
                "gives no length for it; train this data with an objective that reads it (a speech model for audio)"
            )
        self.field_shapes = {name: (int(lengths[name]), np.dtype(stored[name])) for name in stored}
        self.truncated = 0
        self._final_offsets: np.ndarray | None = None

    def _document_offsets(self) -> np.ndarray:
        if self._final_offsets is not None:
            return self._final_offsets
        complete = self.cache.complete  # read first: offsets read after it are then final
        offsets = self.cache.document_offsets()
        if complete:
            self._final_offsets = offsets
        return offsets

    def available(self) -> int:
        return self.cache.num_documents

    def final_length(self) -> int | None:
        if not self.cache.complete:
            return None
        if self.cache.num_documents == 0:
            raise self._too_short("no documents")
        return self.cache.num_documents

    def wait_for(self, n: int) -> None:
        self.cache.wait_for(documents=n)

    def rows(self, indices: np.ndarray) -> Batch:
        indices = np.asarray(indices, np.int64)
        self._check_available(indices, self.available())
        S = self.seq_len
        offsets = self._document_offsets()
        tokens = np.zeros((len(indices), S), np.int32)
        segments = np.zeros((len(indices), S), np.int32)
        cut = np.zeros(len(indices), bool)
        for row, document in enumerate(indices.tolist()):
            start, stop = int(offsets[document]), int(offsets[document + 1])
            used = min(stop - start, S)
            cut[row] |= stop - start > S
            tokens[row, :used] = self.cache.tokens(start, start + used)
            segments[row, :used] = 1
        fields = {}
        for name, (length, dtype) in self.field_shapes.items():
            values = np.zeros((len(indices), length), dtype)
            for row, value in enumerate(self.cache.document_field(name, indices)):
                kept = min(len(value), length)
                values[row, :kept] = value[:kept]
                cut[row] |= len(value) > length
            fields[name] = values
        self.truncated += int(cut.sum())
        return Batch(tokens, _packed_loss_mask(np.ones((len(indices), S), np.float32), segments), segments, fields)


def sequence_dataset(
    cache: TokenCache,
    seq_len: int,
    *,
    packed: bool = False,
    layout: str | None = None,
    field_lengths: Mapping[str, int] | None = None,
) -> SequenceDataset:
    """The sequences of ``cache`` for a format of ``layout`` (``format.layout``: ``stream``,
    ``packed`` or ``document``; default: ``packed`` if ``packed`` else ``stream``).
    ``field_lengths``: for ``document`` layouts, the length of each of the cache's document
    fields in a row (the training objective's :meth:`~levanter_core.objective.Objective.row_lengths`)."""
    layout = layout or ("packed" if packed else "stream")
    if layout == "document":
        return DocumentExamples(cache, seq_len, field_lengths)
    if layout == "packed":
        return PackedSequences(cache, seq_len)
    if layout == "stream":
        return TextSequences(cache, seq_len)
    raise ValueError(f"unknown layout {layout!r}; expected stream, packed or document")


class SlicedSequences(SequenceDataset):
    """Sequences ``start .. stop - 1`` of ``base``, numbered from 0. A negative bound counts
    from the end of the complete cache, as in a Python slice (``stop`` None: to the end).
    ``empty``: the message of the :class:`DataError` raised when the slice holds no sequence,
    with ``{n}`` standing for the number of sequences ``base`` has.

    A slice that ends ``k`` sequences before the end grows with the cache (sequence ``i`` is
    in it once ``i + k`` sequences are available); one that starts from the end waits for the
    complete cache."""

    def __init__(self, base: SequenceDataset, start: int = 0, stop: int | None = None, *, empty: str):
        super().__init__(base.cache, base.seq_len)
        self.base = base
        self.start = start
        self.stop = stop
        self.packed = base.packed
        self.field_shapes = base.field_shapes
        self._empty = empty

    def _bounds(self, n: int) -> tuple[int, int]:
        start = self.start if self.start >= 0 else n + self.start
        stop = n if self.stop is None else min(n, self.stop if self.stop >= 0 else n + self.stop)
        if start < 0 or stop <= start:
            raise DataError(self._empty.format(n=n))
        return start, stop

    def available(self) -> int:
        n = self.base.final_length()
        if n is not None:
            start, stop = self._bounds(n)
            return stop - start
        if self.start < 0:
            return 0
        have = self.base.available()
        if self.stop is not None:
            have = min(have, self.stop) if self.stop >= 0 else have + self.stop
        return max(0, have - self.start)

    def final_length(self) -> int | None:
        n = self.base.final_length()
        if n is None:
            return None
        start, stop = self._bounds(n)
        return stop - start

    def wait_for(self, n: int) -> None:
        if self.start < 0:
            self.base.wait_complete()
        elif self.stop is not None and self.stop < 0:
            self.base.wait_for(self.start + n - self.stop)
        else:
            self.base.wait_for(self.start + n)

    def rows(self, indices: np.ndarray) -> Batch:
        indices = np.asarray(indices, np.int64)
        available = self.available()
        self._check_available(indices, available)
        first = self.start
        if first < 0:  # something is available, so the cache is complete
            first = self._bounds(self.base.final_length())[0]
        return self.base.rows(indices + first)


def held_out(dataset: SequenceDataset, name: str, count: int) -> tuple[SlicedSequences, SlicedSequences]:
    """``data.num_validation_sequences``: source ``name``'s training sequences split into what
    training reads (all but the last ``count``) and the validation set (the last ``count``)."""
    empty = (
        f"data.num_validation_sequences.{name} holds out the last {count} sequences of source {name!r} for "
        f"validation, but its training data has only {{n}} sequences of seq_len {dataset.seq_len}, which leaves "
        "none for training; lower it or add data"
    )
    return SlicedSequences(dataset, 0, -count, empty=empty), SlicedSequences(dataset, -count, None, empty=empty)


class _EpochOrder:
    """Which sequence of ``dataset`` the ``p``-th draw from source ``name`` reads: an endless
    stream of epochs, each all of the dataset's sequences in an order set by ``shuffle``
    (``True``: a keyed permutation; an int N: a keyed permutation within each era of N
    consecutive sequences; ``False``: stored order).

    A *cut* source reads only the first sequences of its first epoch, over and over:
    ``limit`` of them (``data.max_train_batches``), or the share ``fraction`` of all of them
    (simulated epoching, which needs the complete cache). Each pass after the first reads
    them in a new keyed order when ``shuffle`` is on."""

    def __init__(
        self,
        name: str,
        dataset: SequenceDataset,
        seed: int,
        shuffle: bool | int,
        *,
        limit: int | None = None,
        fraction: float | None = None,
    ):
        self.name = name
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.limit = limit
        self.fraction = fraction
        self._cut: int | None = None

    @property
    def is_cut(self) -> bool:
        return self.limit is not None or self.fraction is not None

    def pass_length(self, *, wait: bool) -> int | None:
        """Sequences in one pass over the source; None when not known yet and ``wait`` is false."""
        if self.is_cut:
            return self._cut_length(wait=wait)
        return self.dataset.wait_complete() if wait else self.dataset.final_length()

    def exceeds(self, needed: int, passes: int) -> bool:
        """Whether reading ``needed`` draws takes more than ``passes`` passes over the source;
        waits for the cache only as far as reading those draws would."""
        if self.is_cut:
            return needed > passes * self._cut_length(wait=True)
        if self.dataset.available() >= needed:
            return False
        self.dataset.wait_for(needed)
        if self.dataset.available() >= needed:
            return False
        n = self.dataset.final_length()  # complete: wait_for returned short of `needed`
        return n is not None and needed > passes * n

    def _cut_length(self, *, wait: bool) -> int | None:
        if self.limit is not None:
            n = self.dataset.final_length()
            if n is not None and n < self.limit:
                raise DataError(
                    f"data.max_train_batches.{self.name}: training on the first {self.limit} sequences of source "
                    f"{self.name!r} (max_train_batches x the first train_batch_size), but it has only {n} sequences "
                    f"of seq_len {self.dataset.seq_len}; lower it or add data"
                )
            return self.limit
        if self._cut is None:
            if not wait and self.dataset.final_length() is None:
                return None
            n = self.dataset.wait_complete()
            cut = int(n * self.fraction)
            if cut == 0:
                raise DataError(
                    f"data.experiment_budget / data.target_budget = {self.fraction:.3g} keeps none of the {n} "
                    f"sequences of source {self.name!r}; raise experiment_budget or add data"
                )
            logger.info(
                "simulated epoching: source %s trains on %d of its %d sequences (%.3g)",
                self.name,
                cut,
                n,
                self.fraction,
            )
            self._cut = cut
        return self._cut

    def indices(self, positions: np.ndarray) -> np.ndarray:
        if len(positions) == 0 or not self.is_cut:
            return self._epochs(positions)
        cut = self._cut_length(wait=True)
        passes, within = np.divmod(positions, cut)
        if self.shuffle is not False:
            for p in np.unique(passes[passes > 0]).tolist():
                here = passes == p
                within[here] = Permutation(cut, derive_key(self.seed, self.name, "pass", p))(within[here])
        out = self._epochs(within)
        self._cut_length(wait=False)  # the source may have turned out shorter than the cut
        return out

    def _epochs(self, positions: np.ndarray) -> np.ndarray:
        if len(positions) == 0:
            return np.zeros(0, np.int64)
        if self.shuffle is True:  # the permutation needs the final size
            n = self.dataset.wait_complete()
            epochs, within = np.divmod(positions, n)
            return self._permuted(epochs, within, n)
        self.dataset.wait_for(int(positions.max()) + 1)
        n = self.dataset.final_length()
        if n is None:  # not complete, so every position is available: still the first epoch
            epochs, within = np.zeros_like(positions), positions
        else:
            epochs, within = np.divmod(positions, n)
        if self.shuffle is False:
            return within
        return self._era_permuted(epochs, within, n)

    def _permuted(self, epochs: np.ndarray, within: np.ndarray, n: int) -> np.ndarray:
        out = np.empty_like(within)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            out[here] = Permutation(n, derive_key(self.seed, self.name, int(epoch)))(within[here])
        return out

    def _era_permuted(self, epochs: np.ndarray, within: np.ndarray, n: int | None) -> np.ndarray:
        era_size = int(self.shuffle)
        eras = within // era_size
        out = np.empty_like(within)
        for epoch, era in np.unique(np.stack([epochs, eras], axis=1), axis=0).tolist():
            if n is None:  # the era is shuffled once all of it (or the cache) is there
                self.dataset.wait_for((era + 1) * era_size)
                n = self.dataset.final_length()
            first = era * era_size
            size = era_size if n is None else min(era_size, n - first)
            here = (epochs == epoch) & (eras == era)
            perm = Permutation(size, derive_key(self.seed, self.name, epoch, era))
            out[here] = first + perm(within[here] - first)
        return out


def block_counts(weights: Sequence[float], block_size: int) -> np.ndarray:
    """Sequences of each source in a block of ``block_size``: ``weight * block_size`` rounded
    by largest remainder, so they sum to ``block_size``; a weight of 0 always gets 0."""
    w = np.asarray(weights, np.float64)
    exact = w / w.sum() * block_size
    counts = np.floor(exact).astype(np.int64)
    # The remainders sum to the shortfall and each is below 1, so a weight of 0 (remainder 0)
    # is never among the largest that get one more.
    counts[np.argsort(counts - exact, kind="stable")[: block_size - counts.sum()]] += 1
    return counts


@functools.lru_cache(maxsize=16)
def _block_layout(counts: tuple[int, ...], key: int) -> tuple[np.ndarray, np.ndarray]:
    """For each slot of a block: its source, and how many earlier slots drew from that source."""
    block_size = sum(counts)
    labels = np.repeat(np.arange(len(counts)), counts)
    labels = labels[Permutation(block_size, key)(np.arange(block_size))]
    order = np.argsort(labels, kind="stable")
    first_slot = np.cumsum(counts) - np.asarray(counts)
    ranks = np.empty(block_size, np.int64)
    ranks[order] = np.arange(block_size) - first_slot[labels[order]]
    return labels, ranks


class _Mixture:
    """Block-wise mixing: stream positions ``[j*K, (j+1)*K)`` form block ``j``, holding
    exactly each source's count for the stage active at the block, in a keyed order. A
    stage starts at the first block that starts at or after its first step's stream position
    (``stage_starts``, one per stage). Where a source's draws stand at any block is a sum over
    stages, so a position is placed without visiting earlier blocks."""

    def __init__(self, stages: Sequence[tuple[int, np.ndarray]], block_size: int, seed: int):
        self.steps = [step for step, _ in stages]
        self.counts = np.stack([block_counts(w, block_size) for _, w in stages])
        self.block_size = block_size
        self.seed = seed

    def locate(self, positions: np.ndarray, stage_starts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The source of each stream position and the position within that source's draws."""
        blocks, slots = np.divmod(positions, self.block_size)
        sources = np.empty_like(positions)
        drawn = np.empty_like(positions)
        for block in np.unique(blocks).tolist():
            offsets = self._drawn_before_block(block, stage_starts)
            labels, ranks = self._layout(block, stage_starts)
            here = blocks == block
            sources[here] = labels[slots[here]]
            drawn[here] = offsets[sources[here]] + ranks[slots[here]]
        return sources, drawn

    def drawn_before(self, position: int, stage_starts: Sequence[int]) -> np.ndarray:
        """How many draws each source has at the stream positions before ``position``."""
        block, slot = divmod(position, self.block_size)
        drawn = self._drawn_before_block(block, stage_starts)
        if slot:
            labels, _ = self._layout(block, stage_starts)
            drawn = drawn + np.bincount(labels[:slot], minlength=len(drawn))
        return drawn

    def position_of(self, source: int, draw: int, stage_starts: Sequence[int]) -> int | None:
        """The stream position of draw ``draw`` (from 0) of ``source``; None if never reached."""
        first_blocks = self._first_blocks(stage_starts)
        done = 0
        for stage, first in enumerate(first_blocks.tolist()):
            count = int(self.counts[stage, source])
            last = stage + 1 == len(first_blocks)
            blocks = None if last else max(int(first_blocks[stage + 1]) - first, 0)
            if count and (blocks is None or draw < done + blocks * count):
                block = first + (draw - done) // count
                labels, ranks = self._layout(block, stage_starts)
                slot = int(np.flatnonzero((labels == source) & (ranks == (draw - done) % count))[0])
                return block * self.block_size + slot
            if blocks is None:
                return None
            done += blocks * count
        return None

    def _drawn_before_block(self, block: int, stage_starts: Sequence[int]) -> np.ndarray:
        first_blocks = self._first_blocks(stage_starts)
        stage_ends = np.append(first_blocks[1:], np.iinfo(np.int64).max)
        blocks_before = np.clip(np.minimum(block, stage_ends) - first_blocks, 0, None)  # per stage
        return blocks_before @ self.counts

    def _layout(self, block: int, stage_starts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        stage = int(np.searchsorted(self._first_blocks(stage_starts), block, side="right")) - 1
        return _block_layout(tuple(self.counts[stage].tolist()), derive_key(self.seed, "mixture", block))

    def _first_blocks(self, stage_starts: Sequence[int]) -> np.ndarray:
        return np.array([-(-int(start) // self.block_size) for start in stage_starts], np.int64)


class TrainStream:
    """The training stream over named sequence datasets: ``batch(step, batch_size)``.

    ``stages``: ``[(first_step, {name: weight})]`` as :meth:`DataConfig.weight_stages` gives
    (None: equal weights). A source with weight 0 in every stage is never read. ``shuffle``
    is ``DataConfig.effective_shuffle``. With one source read, no mixing is done.

    ``limits``: per source, train on only the first that many sequences (of its first epoch's
    order), repeated. ``fraction``: every source cut to that share of its sequences
    (simulated epoching). ``stop_strategy``: ``restart`` (endless), ``first_exhausted`` (the
    stream ends where any source would start its second pass) or ``all_exhausted`` (sources
    restart until each has run out once; the stream ends where the last one does).
    ``max_epochs`` (one source only): the stream ends after that many passes; 0: no limit.
    ``offsets``: the stream position of a step's first sequence, for a batch-size schedule
    (places the weight stages, which are given in steps); default ``step * batch_size``.
    ``initial_batch_size``: the first step's batch size, for :meth:`end_position`."""

    def __init__(
        self,
        datasets: Mapping[str, SequenceDataset],
        *,
        seed: int,
        shuffle: bool | int = True,
        stages: Sequence[tuple[int, Mapping[str, float]]] | None = None,
        block_size: int = 2048,
        limits: Mapping[str, int] | None = None,
        fraction: float | None = None,
        stop_strategy: str = "restart",
        max_epochs: int = 0,
        offsets: Callable[[int], int] | None = None,
        initial_batch_size: int | None = None,
    ):
        if stages is None:
            stages = [(0, dict.fromkeys(datasets, 1.0))]
        names = sorted({name for _, weights in stages for name, w in weights.items() if w > 0})
        missing = [name for name in names if name not in datasets]
        if missing:
            raise DataError(
                f"data.train_weights: source {', '.join(missing)} has a positive weight but no training data"
            )
        lengths = {datasets[name].seq_len for name in names}
        if len(lengths) != 1:
            raise ValueError(f"the sources' datasets have different seq_len: {sorted(lengths)}")
        if stop_strategy not in ("restart", "first_exhausted", "all_exhausted"):
            raise ValueError(f"unknown stop_strategy {stop_strategy!r}")
        if max_epochs and len(names) > 1:
            raise ValueError("max_epochs limits the passes over a single source; this stream mixes several")
        self.names = names
        self.seq_len = lengths.pop()
        # Every batch has the same structure (a pytree the step is compiled for): with loss
        # masks and segments as soon as one source read is packed, and the same fields.
        self.packed = any(datasets[name].packed for name in names)
        shapes = {name: datasets[name].field_shapes for name in names}
        if len({repr(sorted(s.items())) for s in shapes.values()}) > 1:
            described = "; ".join(f"{name}: {', '.join(s) or 'tokens only'}" for name, s in shapes.items())
            raise DataError(
                f"data.train_weights: the sources trained on give batches of different kinds ({described}); "
                "a run trains on sources of one kind (all text, or all audio with transcripts)"
            )
        self.field_shapes = shapes[names[0]] if names else {}
        limits = limits or {}
        self._orders = [
            _EpochOrder(name, datasets[name], seed, shuffle, limit=limits.get(name), fraction=fraction)
            for name in names
        ]
        for order in self._orders:
            if order.limit is not None:
                logger.info(
                    "source %s: training on its first %d sequences (data.max_train_batches)", order.name, order.limit
                )
        self.stop_strategy = stop_strategy
        self.max_epochs = max_epochs
        # The passes any source may take before the stream ends (None: no such limit).
        passes = [p for p in (1 if stop_strategy == "first_exhausted" else None, max_epochs or None) if p]
        self._passes = min(passes) if passes else None
        self._offsets = offsets
        self._initial_batch_size = initial_batch_size
        self._mixture = None
        if len(names) > 1:
            weights = [(step, np.array([w.get(name, 0.0) for name in names])) for step, w in stages]
            self._mixture = _Mixture(weights, block_size, seed)

    @classmethod
    def from_config(
        cls,
        datasets: Mapping[str, SequenceDataset],
        config: DataConfig,
        seed: int,
        *,
        initial_batch_size: int | None = None,
        max_epochs: int = 0,
        offsets: Callable[[int], int] | None = None,
    ) -> TrainStream:
        """The stream that ``config`` (the ``data:`` section) describes over the training
        ``datasets``, seeded by ``seed`` (``data_seed`` or ``trainer.seed``).

        ``initial_batch_size``: the batch size at step 0 (``data.max_train_batches`` counts in
        batches of it; required when that is set). ``max_epochs``: the top-level ``epoch``.
        ``offsets``: step -> stream position of its first sequence, with a batch-size
        schedule. ``data.num_validation_sequences`` holds the last sequences of those sources
        out of ``datasets`` here; :func:`held_out` gives the validation part."""
        datasets = dict(datasets)
        for name, count in (config.num_validation_sequences or {}).items():
            if name in datasets:
                datasets[name] = held_out(datasets[name], name, count)[0]
                logger.info("source %s: its last %d training sequences are held out for validation", name, count)
        limits = {}
        if config.max_train_batches:
            if initial_batch_size is None:
                raise ValueError("data.max_train_batches needs the initial batch size (initial_batch_size)")
            limits = {name: batches * initial_batch_size for name, batches in config.max_train_batches.items()}
        return cls(
            datasets,
            seed=seed,
            shuffle=config.effective_shuffle,
            stages=config.weight_stages(),
            block_size=config.mixture_block_size,
            limits=limits,
            fraction=config.budget_fraction,
            stop_strategy=config.stop_strategy,
            max_epochs=max_epochs,
            offsets=offsets,
            initial_batch_size=initial_batch_size,
        )

    @property
    def endless(self) -> bool:
        """Whether the stream never ends (``restart`` and no ``max_epochs``)."""
        return self._passes is None and self.stop_strategy != "all_exhausted"

    def batch(self, step: int, batch_size: int, rows: np.ndarray | None = None, *, start: int | None = None) -> Batch:
        """Stream positions ``start ..`` ``start + batch_size - 1`` (``start`` default
        ``step * batch_size``; with a batch-size schedule, where the step's batch starts).
        Waits for the cache where they are not yet built, and raises its build's error.
        ``rows``: only these rows of the batch, in this order (a process of a multi-process
        run reads its share only); the rows are the same whichever others are read.

        Raises :class:`DataExhausted` when the batch would read past the end of the stream
        (a batch only partly there raises too: partial batches are dropped)."""
        if start is None:
            start = step * batch_size
        stage_starts = self._stage_starts(batch_size)
        self._check_not_ended(step, start, start + batch_size, stage_starts)
        if rows is None:
            rows = np.arange(batch_size, dtype=np.int64)
        positions = start + np.asarray(rows, np.int64)
        if self._mixture is None:
            sources, drawn = np.zeros_like(positions), positions
        else:
            sources, drawn = self._mixture.locate(positions, stage_starts)
        parts = []
        for source in np.unique(sources).tolist():
            here = sources == source
            order = self._orders[source]
            parts.append((here, order.dataset.rows(order.indices(drawn[here]))))
        return _assemble(len(positions), self.seq_len, parts, self.packed, self.field_shapes)

    def end_position(self, batch_size: int | None = None) -> int | None:
        """The stream position where the stream ends (a batch reaching past it raises
        :class:`DataExhausted`); None when it is endless or not known yet (a source's cache
        is still being built). Never waits. ``batch_size`` places staged weights when there
        is no ``offsets`` (default: ``initial_batch_size``)."""
        if self.endless:
            return None
        stage_starts = self._stage_starts(batch_size or self._initial_batch_size)
        if stage_starts is None:
            return None
        lengths = [order.pass_length(wait=False) for order in self._orders]
        if any(length is None for length in lengths):
            return None
        return self._end(lengths, stage_starts)

    def template(self, batch_size: int) -> Batch:
        """A batch of zeros with the shapes and structure of every batch of this stream (to
        compile the training step before the data is there)."""
        return _assemble(batch_size, self.seq_len, [], self.packed, self.field_shapes)

    # -- where the stream ends

    def _stage_starts(self, batch_size: int | None) -> list[int] | None:
        steps = [0] if self._mixture is None else self._mixture.steps
        if self._offsets is not None:
            return [int(self._offsets(step)) for step in steps]
        if batch_size is None:
            return None if len(steps) > 1 else [0]
        return [step * batch_size for step in steps]

    def _drawn_before(self, position: int, stage_starts: list[int]) -> list[int]:
        if self._mixture is None:
            return [position]
        return self._mixture.drawn_before(position, stage_starts).tolist()

    def _position_of(self, source: int, draw: int, stage_starts: list[int]) -> int | None:
        if self._mixture is None:
            return draw
        return self._mixture.position_of(source, draw, stage_starts)

    def _end(self, lengths: list[int], stage_starts: list[int]) -> int | None:
        ends = []
        if self._passes is not None:  # the first source to use up its passes ends the stream
            found = [self._position_of(s, self._passes * n, stage_starts) for s, n in enumerate(lengths)]
            ends += [min(p for p in found if p is not None)] if any(p is not None for p in found) else []
        if self.stop_strategy == "all_exhausted":  # the last source to run out ends it
            found = [self._position_of(s, n, stage_starts) for s, n in enumerate(lengths)]
            ends += [max(found)] if all(p is not None for p in found) else []
        return min(ends) if ends else None

    def _check_not_ended(self, step: int, start: int, stop: int, stage_starts: list[int]) -> None:
        if self.endless:
            return
        needed = self._drawn_before(stop, stage_starts)
        why = None
        if self._passes is not None:
            for order, n in zip(self._orders, needed):
                if n and order.exceeds(n, self._passes):
                    length = order.pass_length(wait=True)
                    passes = f"{self._passes} passes" if self._passes > 1 else "one pass"
                    reason = "epoch" if self._passes == self.max_epochs else "data.stop_strategy: first_exhausted"
                    source = f"source {order.name!r}" if self._mixture is not None else "the training data"
                    why = f"{source} ran out after {passes} over its {length} sequences ({reason})"
                    break
        if (
            why is None
            and self.stop_strategy == "all_exhausted"
            and all(order.exceeds(n, 1) for order, n in zip(self._orders, needed))
        ):
            sources = "every source has" if self._mixture is not None else "the training data has"
            why = f"{sources} run out at least once (data.stop_strategy: all_exhausted)"
        if why is None:
            return
        lengths = [order.pass_length(wait=True) for order in self._orders]
        end = self._end(lengths, stage_starts)
        raise DataExhausted(
            step,
            f"step {step}: the training stream has ended: {why}; this batch would read stream positions "
            f"{start}..{stop - 1}, but the stream ends at position {end}",
        )


def _assemble(
    batch_size: int,
    seq_len: int,
    parts: list[tuple[np.ndarray, Batch]],
    packed: bool,
    field_shapes: Mapping[str, tuple[int, np.dtype]] | None = None,
) -> Batch:
    """One batch from row groups (``where``, rows); when ``packed``, a text source's rows get
    the packed defaults (one segment, loss everywhere but the last position). ``field_shapes``:
    the fields every row holds (zeros in a template)."""
    tokens = np.zeros((batch_size, seq_len), np.int32)
    fields = {name: np.zeros((batch_size, length), dtype) for name, (length, dtype) in (field_shapes or {}).items()}
    for where, rows in parts:
        tokens[where] = rows.tokens
        for name, values in fields.items():
            values[where] = rows.fields[name]
    if not packed:
        return Batch(tokens, fields=fields or None)
    loss_mask = np.ones((batch_size, seq_len), np.float32)
    loss_mask[:, -1] = 0.0
    segment_ids = np.ones((batch_size, seq_len), np.int32)
    for where, rows in parts:
        if rows.segment_ids is not None:
            loss_mask[where] = rows.loss_mask
            segment_ids[where] = rows.segment_ids
    return Batch(tokens, loss_mask, segment_ids, fields or None)


def eval_batches(
    dataset: SequenceDataset, batch_size: int, max_batches: int | None = None, rows: np.ndarray | None = None
) -> Iterator[Batch]:
    """Full batches in stored order, once the cache is complete. A set of fewer sequences
    than ``batch_size`` gives one batch that wraps around, so a small set still evaluates.
    ``rows``: only these rows of each batch (this process's share)."""
    n = dataset.wait_complete()
    num_batches = max(n // batch_size, 1)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    if rows is None:
        rows = np.arange(batch_size, dtype=np.int64)
    for b in range(num_batches):
        yield dataset.rows((b * batch_size + np.asarray(rows, np.int64)) % n)
