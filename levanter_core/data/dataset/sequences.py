"""The sequence datasets over one tokenized cache: :class:`TextSequences`,
:class:`PackedSequences` and :class:`DocumentExamples` (one per format layout, chosen by
:func:`sequence_dataset`), :class:`SlicedSequences` (a part of one, such as the sequences
:func:`held_out` for validation), and :func:`eval_batches`, which reads one in stored order.
Each numbers its sequences in stored order and says which are final; what order training reads
them in is :mod:`~levanter_core.data.dataset.stream`'s business."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np

from levanter_core.data.permutation import Permutation, derive_key
from levanter_core.errors import DataError

TOO_SHORT_HINT = "add data or shorten the sequences"
"""What a cache too short for one sequence is told to do."""

if TYPE_CHECKING:
    from levanter_core.data.cache import TokenCache


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
        if first < 0:  # a slice from the end: something is available only once the cache is complete
            n = self.base.final_length()
            if n is None:  # nothing is available yet, so `indices` is empty
                return self.base.rows(indices)
            first = self._bounds(n)[0]
        return self.base.rows(indices + first)


def held_out(
    dataset: SequenceDataset, name: str, count: int | float, *, shuffled: bool = False
) -> tuple[SlicedSequences, SlicedSequences]:
    """Source ``name``'s training sequences split into what training reads and the validation
    set: the last ``count`` (an int: ``data.num_validation_sequences``), or the last fraction
    ``count`` of them (a float: ``data.validation_split_fraction``, see :func:`held_out_count`).
    ``shuffled``: of the sequences in a fixed keyed order (:class:`SplitOrder`), so that the
    validation set is a random subset (``data.shuffle_before_trainval_split``)."""
    if shuffled:
        dataset = SplitOrder(dataset)
    if isinstance(count, float):
        empty = (
            f"data.validation_split_fraction ({count}) holds out part of source {name!r}, but its training data "
            f"has only {{n}} sequence(s) of seq_len {dataset.seq_len}, too few to split; add data or set "
            "validation_split_fraction to null"
        )
        return _FractionSlice(dataset, count, False, empty=empty), _FractionSlice(dataset, count, True, empty=empty)
    empty = (
        f"data.num_validation_sequences.{name} holds out the last {count} sequences of source {name!r} for "
        f"validation, but its training data has only {{n}} sequences of seq_len {dataset.seq_len}, which leaves "
        "none for training; lower it or add data"
    )
    return SlicedSequences(dataset, 0, -count, empty=empty), SlicedSequences(dataset, -count, None, empty=empty)


class SplitOrder(SequenceDataset):
    """``base``'s sequences in one fixed keyed order, the same for every run and seed (Levanter's
    ``shuffle_before_trainval_split``: the split takes its tail, a random subset, for validation,
    and training shuffles the rest as it shuffles anything). The order needs the number of
    sequences, so nothing is available before the cache is complete."""

    KEY = derive_key("train/validation split")

    def __init__(self, base: SequenceDataset):
        super().__init__(base.cache, base.seq_len)
        self.base = base
        self.packed = base.packed
        self.field_shapes = base.field_shapes
        self._order: Permutation | None = None

    def available(self) -> int:
        return self.base.final_length() or 0

    def final_length(self) -> int | None:
        return self.base.final_length()

    def wait_for(self, n: int) -> None:
        self.base.wait_complete()

    def rows(self, indices: np.ndarray) -> Batch:
        indices = np.asarray(indices, np.int64)
        n = self.available()
        self._check_available(indices, n)
        if not len(indices):
            return self.base.rows(indices)
        if self._order is None or self._order.n != n:
            self._order = Permutation(n, self.KEY)
        return self.base.rows(np.asarray(self._order(indices), np.int64))


def held_out_count(n: int, fraction: float) -> int:
    """How many of ``n`` sequences ``validation_split_fraction`` holds out, as Levanter counts
    them: ``int(n x fraction)``, at least 1 and at most ``n - 1``; 0 for ``n <= 1`` or no fraction."""
    if n <= 1 or fraction <= 0:
        return 0
    return min(max(int(n * fraction), 1), n - 1)


class _FractionSlice(SlicedSequences):
    """The training part (``validation`` false) or the held-out tail of ``base`` split by a
    fraction of its size: known once the cache is complete, so both wait for that."""

    def __init__(self, base: SequenceDataset, fraction: float, validation: bool, *, empty: str):
        super().__init__(base, -1, None, empty=empty)  # from the end: waits for the complete cache
        self.fraction, self.validation = fraction, validation

    def _bounds(self, n: int) -> tuple[int, int]:
        k = held_out_count(n, self.fraction)
        start, stop = (n - k, n) if self.validation else (0, n - k)
        if stop <= start:
            raise DataError(self._empty.format(n=n))
        return start, stop


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
