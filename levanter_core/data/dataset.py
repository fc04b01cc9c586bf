"""Sequences of ``seq_len`` tokens read from a tokenized cache, and the batches training reads.

Two kinds of sequence dataset sit over one cache (the same cache serves any ``seq_len``):

* :class:`TextSequences` (formats that are not packed): the token stream of all documents,
  cut into consecutive ``seq_len`` windows (the tail that does not fill one is dropped);
* :class:`PackedSequences` (chat, supervised): whole examples packed greedily, in order,
  into ``seq_len`` slots, with segment ids so attention does not cross examples and a loss
  mask from the examples' target masks.

:class:`TrainStream` turns named datasets into the training stream: each source an endless
stream of epochs (a keyed permutation, an era shuffle, or in order), mixed block-wise by
``train_weights``. The batch at step N holds stream positions ``N*B .. N*B+B-1`` and is
computed directly from (seed, data config, N), never by reading through earlier steps; it
does not depend on how fast the cache was built, because a sequence is only read once it is
final, and reading one that is not waits for the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import TYPE_CHECKING, Iterator, Mapping, Sequence

import numpy as np

from levanter_core.data.permutation import Permutation, derive_key
from levanter_core.errors import DataError

if TYPE_CHECKING:
    from levanter_core.data.cache import TokenCache
    from levanter_core.data.config import DataConfig


@dataclasses.dataclass(frozen=True)
class Batch:
    """Sequences for one step.

    ``tokens``: int32 ``[B, S]``. ``loss_mask``: float32 ``[B, S]``, the weight of predicting
    ``tokens[b, t + 1]`` from position ``t``; None means every position but the last.
    ``segment_ids``: int32 ``[B, S]``, 1, 2, 3... for the examples packed in a row and 0 for
    padding; None for plain text streams (one causal sequence per row)."""

    tokens: np.ndarray
    loss_mask: np.ndarray | None = None
    segment_ids: np.ndarray | None = None


class SequenceDataset:
    """Sequences of ``seq_len`` tokens over one cache, numbered in stored order.

    A sequence is *available* once it is final: it will read the same whatever the cache
    adds later. ``final_length()`` is known once the cache is complete."""

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
            "add data or shorten the sequences"
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


def sequence_dataset(cache: TokenCache, seq_len: int, *, packed: bool) -> SequenceDataset:
    """The sequences of ``cache`` for a format that is ``packed`` (``format.packed``) or not."""
    return PackedSequences(cache, seq_len) if packed else TextSequences(cache, seq_len)


class _EpochOrder:
    """Which sequence of ``dataset`` the ``p``-th draw from source ``name`` reads: an endless
    stream of epochs, each all of the dataset's sequences in an order set by ``shuffle``
    (``True``: a keyed permutation; an int N: a keyed permutation within each era of N
    consecutive sequences; ``False``: stored order)."""

    def __init__(self, name: str, dataset: SequenceDataset, seed: int, shuffle: bool | int):
        self.name = name
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle

    def indices(self, positions: np.ndarray) -> np.ndarray:
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
    exactly each source's count for the stage active at the block's first step, in a keyed
    order. Where a source's draws stand at any block is a sum over stages, so a position is
    placed without visiting earlier blocks."""

    def __init__(self, stages: Sequence[tuple[int, np.ndarray]], block_size: int, seed: int):
        self.steps = [step for step, _ in stages]
        self.counts = np.stack([block_counts(w, block_size) for _, w in stages])
        self.block_size = block_size
        self.seed = seed

    def locate(self, positions: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The source of each stream position and the position within that source's draws."""
        blocks, slots = np.divmod(positions, self.block_size)
        first_blocks = self._first_blocks(batch_size)
        stage_ends = np.append(first_blocks[1:], np.iinfo(np.int64).max)
        sources = np.empty_like(positions)
        drawn = np.empty_like(positions)
        for block in np.unique(blocks).tolist():
            stage = int(np.searchsorted(first_blocks, block, side="right")) - 1
            blocks_before = np.clip(np.minimum(block, stage_ends) - first_blocks, 0, None)  # per stage
            offsets = blocks_before @ self.counts
            labels, ranks = _block_layout(tuple(self.counts[stage].tolist()), derive_key(self.seed, "mixture", block))
            here = blocks == block
            sources[here] = labels[slots[here]]
            drawn[here] = offsets[sources[here]] + ranks[slots[here]]
        return sources, drawn

    def _first_blocks(self, batch_size: int) -> np.ndarray:
        """The first block of each stage: the first whose first step ``j*K // B`` reaches it."""
        return np.array([-(-step * batch_size // self.block_size) for step in self.steps], np.int64)


class TrainStream:
    """The training stream over named sequence datasets: ``batch(step, batch_size)``.

    ``stages``: ``[(first_step, {name: weight})]`` as :meth:`DataConfig.weight_stages` gives
    (None: equal weights). A source with weight 0 in every stage is never read. ``shuffle``
    is ``DataConfig.shuffle``. With one source read, no mixing is done."""

    def __init__(
        self,
        datasets: Mapping[str, SequenceDataset],
        *,
        seed: int,
        shuffle: bool | int = True,
        stages: Sequence[tuple[int, Mapping[str, float]]] | None = None,
        block_size: int = 2048,
    ):
        if stages is None:
            stages = [(0, {name: 1.0 for name in datasets})]
        names = sorted({name for _, weights in stages for name, w in weights.items() if w > 0})
        missing = [name for name in names if name not in datasets]
        if missing:
            raise DataError(
                f"data.train_weights: source {', '.join(missing)} has a positive weight but no training data"
            )
        lengths = {datasets[name].seq_len for name in names}
        if len(lengths) != 1:
            raise ValueError(f"the sources' datasets have different seq_len: {sorted(lengths)}")
        self.names = names
        self.seq_len = lengths.pop()
        # Every batch has the same structure (a pytree the step is compiled for): with loss
        # masks and segments as soon as one source read is packed.
        self.packed = any(isinstance(datasets[name], PackedSequences) for name in names)
        self._orders = [_EpochOrder(name, datasets[name], seed, shuffle) for name in names]
        self._mixture = None
        if len(names) > 1:
            weights = [(step, np.array([w.get(name, 0.0) for name in names])) for step, w in stages]
            self._mixture = _Mixture(weights, block_size, seed)

    @classmethod
    def from_config(cls, datasets: Mapping[str, SequenceDataset], config: DataConfig, seed: int) -> TrainStream:
        """The stream that ``config`` (the ``data:`` section) describes, seeded by ``trainer.seed``."""
        return cls(
            datasets,
            seed=seed,
            shuffle=config.shuffle,
            stages=config.weight_stages(),
            block_size=config.mixture_block_size,
        )

    def batch(self, step: int, batch_size: int, rows: np.ndarray | None = None) -> Batch:
        """Stream positions ``step * batch_size ..`` ``+ batch_size - 1``; waits for the
        cache where they are not yet built, and raises its build's error. ``rows``: only
        these rows of the batch, in this order (a process of a multi-process run reads its
        share only); the rows are the same whichever others are read."""
        if rows is None:
            rows = np.arange(batch_size, dtype=np.int64)
        positions = step * batch_size + np.asarray(rows, np.int64)
        if self._mixture is None:
            sources, drawn = np.zeros_like(positions), positions
        else:
            sources, drawn = self._mixture.locate(positions, batch_size)
        parts = []
        for source in np.unique(sources).tolist():
            here = sources == source
            order = self._orders[source]
            parts.append((here, order.dataset.rows(order.indices(drawn[here]))))
        return _assemble(len(positions), self.seq_len, parts, self.packed)

    def template(self, batch_size: int) -> Batch:
        """A batch of zeros with the shapes and structure of every batch of this stream (to
        compile the training step before the data is there)."""
        return _assemble(batch_size, self.seq_len, [], self.packed)


def _assemble(batch_size: int, seq_len: int, parts: list[tuple[np.ndarray, Batch]], packed: bool) -> Batch:
    """One batch from row groups (``where``, rows); when ``packed``, a text source's rows get
    the packed defaults (one segment, loss everywhere but the last position)."""
    tokens = np.zeros((batch_size, seq_len), np.int32)
    for where, rows in parts:
        tokens[where] = rows.tokens
    if not packed:
        return Batch(tokens)
    loss_mask = np.ones((batch_size, seq_len), np.float32)
    loss_mask[:, -1] = 0.0
    segment_ids = np.ones((batch_size, seq_len), np.int32)
    for where, rows in parts:
        if rows.segment_ids is not None:
            loss_mask[where] = rows.loss_mask
            segment_ids[where] = rows.segment_ids
    return Batch(tokens, loss_mask, segment_ids)


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
