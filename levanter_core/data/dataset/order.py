"""The order in which one source's sequences are read: :class:`_EpochOrder` maps the ``p``-th
draw from a source to one of its sequences (passes of a keyed permutation, an era shuffle, or
stored order; possibly cut to a part of the source)."""

from __future__ import annotations

import logging
from typing import Literal, overload

import numpy as np

from levanter_core.data.dataset.sequences import SequenceDataset
from levanter_core.data.permutation import Permutation, derive_key
from levanter_core.errors import DataError

# The package's logger, as before the split: log lines still name levanter_core.data.dataset.
logger = logging.getLogger(__package__)


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

    @overload
    def pass_length(self, *, wait: Literal[True]) -> int: ...
    @overload
    def pass_length(self, *, wait: bool) -> int | None: ...
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

    @overload
    def _cut_length(self, *, wait: Literal[True]) -> int: ...
    @overload
    def _cut_length(self, *, wait: bool) -> int | None: ...
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
            assert self.fraction is not None  # a cut source without a limit has a fraction (is_cut)
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
            total = self.dataset.wait_complete()
            epochs, within = np.divmod(positions, total)
            return self._permuted(epochs, within, total)
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
