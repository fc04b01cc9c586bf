"""Token streams cut into fixed-length sequences, and the batches training reads.

The training batch at step N is a pure function of (seed, N): sample positions
``N*B .. N*B+B-1`` of an endless stream of epochs, each epoch a permutation of
all sequences drawn from (seed, epoch). Resuming at step N therefore reads only
the sequences of step N.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from levanter_core.data.cache import build_or_load_cache
from levanter_core.data.source import DataSourceConfig
from levanter_core.data.tokenizer import Tokenizer, load_tokenizer
from levanter_core.errors import DataError


class TokenSequenceDataset:
    """``len(tokens) // seq_len`` consecutive sequences of ``seq_len`` tokens (the tail
    that does not fill a sequence is dropped)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, *, seed: int = 0, shuffle: bool = True):
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self._tokens = tokens
        self._num_sequences = len(tokens) // seq_len
        self._permutations: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self._num_sequences

    def sequence(self, i: int) -> np.ndarray:
        """Sequence ``i`` (in stored order) as int32 ``[seq_len]``."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        return self._gather(np.array([i]))[0]

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        """The training batch at ``step``, int32 ``[batch_size, seq_len]``."""
        self._check_not_empty()
        positions = step * batch_size + np.arange(batch_size, dtype=np.int64)
        epochs, within = np.divmod(positions, len(self))
        indices = np.empty_like(positions)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            indices[here] = self._epoch_order(int(epoch))[within[here]]
        return self._gather(indices)

    def eval_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[np.ndarray]:
        """Batches in stored order, full ones only. With fewer sequences than
        ``batch_size``, one batch that wraps around, so a small set still evaluates."""
        self._check_not_empty()
        num_batches = max(len(self) // batch_size, 1)
        if max_batches is not None:
            num_batches = min(num_batches, max_batches)
        for b in range(num_batches):
            yield self._gather((b * batch_size + np.arange(batch_size)) % len(self))

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self))
        if epoch not in self._permutations:
            # A batch spans at most two epochs, so two permutations are all we keep.
            if len(self._permutations) >= 2:
                self._permutations.pop(min(self._permutations))
            rng = np.random.default_rng([self.seed % 2**64, epoch])
            self._permutations[epoch] = rng.permutation(len(self))
        return self._permutations[epoch]

    def _gather(self, indices: np.ndarray) -> np.ndarray:
        starts = indices[:, None] * self.seq_len + np.arange(self.seq_len)
        return self._tokens[starts].astype(np.int32)

    def _check_not_empty(self) -> None:
        if not len(self):
            raise ValueError(f"no sequences: {len(self._tokens)} tokens are fewer than seq_len {self.seq_len}")


@dataclasses.dataclass(frozen=True)
class LmData:
    """What training needs from the data: the tokenizer and the sequences of each split."""

    tokenizer: Tokenizer
    train: TokenSequenceDataset
    validation: TokenSequenceDataset | None


def build_lm_data(config: DataSourceConfig, *, seq_len: int, seed: int, progress: bool = True) -> LmData:
    """Load the tokenizer, build (or reuse) the cache of each split and cut it into
    ``seq_len`` sequences. Raises :class:`DataError` on unreadable or too little data."""
    tokenizer = load_tokenizer(config.tokenizer)
    if not config.has_split("train"):
        raise DataError(f"data ({config.type}): no training data is configured (set data.train_urls)")
    train = _split_dataset(config, "train", tokenizer, seq_len, seed, progress)
    validation = None
    if config.has_split("validation"):
        validation = _split_dataset(config, "validation", tokenizer, seq_len, seed, progress)
    return LmData(tokenizer, train, validation)


def _split_dataset(
    config: DataSourceConfig, split: str, tokenizer: Tokenizer, seq_len: int, seed: int, progress: bool
) -> TokenSequenceDataset:
    cache = build_or_load_cache(config, split, tokenizer, progress=progress)
    if cache.num_tokens < seq_len:
        raise DataError(
            f"data ({config.type}): the {split} split has {cache.num_tokens} tokens, fewer than one "
            f"sequence of seq_len {seq_len}; add data or shorten the sequences"
        )
    shuffle = config.shuffle and split == "train"  # evaluation reads in order
    return TokenSequenceDataset(cache.tokens(), seq_len, seed=seed, shuffle=shuffle)
