"""Block-wise mixing of sources: which source each stream position draws from, and how many
draws each source has had before it, by ``train_weights`` (possibly staged), computed for any
position without visiting earlier ones."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from levanter_core.data.permutation import Permutation, derive_key


def block_counts(weights: Sequence[float] | np.ndarray, block_size: int) -> np.ndarray:
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
