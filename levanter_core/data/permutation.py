"""A keyed pseudo-random permutation of ``[0, n)`` that never materializes the order.

Shuffling billions of sequences with ``rng.permutation(n)`` costs 8 bytes per sequence
and time proportional to ``n`` before the first batch. Instead, the position of any
element is computed on demand: a balanced Feistel network permutes ``[0, 4**h)`` (the
smallest power of 4 at or above ``n``), and *cycle walking* maps it onto ``[0, n)``: an
output at or past ``n`` is fed through again until it lands inside. Because the network
is a bijection of the larger domain, walking from an element of ``[0, n)`` always comes
back into it, so the result is a bijection of ``[0, n)``; since ``4**h < 4 n`` the walk
takes fewer than 4 rounds on average.

Keys come from :func:`derive_key`, a stable hash (BLAKE2b) of the parts that name a
permutation, e.g. ``(seed, source name, epoch)``, so the same order is drawn in every
process and every Python version (Python's ``hash`` is salted per process).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

ROUNDS = 8
"""Feistel rounds: 4 already give a pseudo-random permutation in theory; 8 mix small domains well."""


def derive_key(*parts: int | str) -> int:
    """A 64-bit key determined by ``parts`` (ints and strings), the same in every process."""
    text = json.dumps(list(parts), separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijective avalanche mix of uint64 values (wraps mod 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A bijection of ``[0, n)`` chosen by ``key``; O(1) memory, vectorized over numpy arrays.

    ``perm(indices)`` gives the image of each index, ``perm.inverse(values)`` undoes it.
    """

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError(f"a permutation needs at least one element, got n={n}")
        self.n = int(n)
        self.key = int(key)
        # h bits per half, so the network permutes [0, 4**h) with 4**h >= n (h >= 1).
        self._half_bits = max(1, ((self.n - 1).bit_length() + 1) // 2)
        self._half_mask = np.uint64((1 << self._half_bits) - 1)
        seeds = np.arange(1, ROUNDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        self._round_keys = _mix(seeds ^ np.uint64(self.key & (2**64 - 1)))

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        return self._walk(indices, self._forward)

    def inverse(self, values: np.ndarray) -> np.ndarray:
        """The indices that :meth:`__call__` maps to ``values``."""
        return self._walk(values, self._backward)

    def _walk(self, x, step) -> np.ndarray:
        x = np.asarray(x)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"index out of range for a permutation of {self.n} (got {x.min()}..{x.max()})")
        out = step(x.astype(np.uint64))
        outside = out >= self.n
        while outside.any():
            out[outside] = step(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)

    def _round(self, r: int, half: np.ndarray) -> np.ndarray:
        return _mix(half ^ self._round_keys[r]) & self._half_mask

    def _forward(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half_bits)
        left, right = x >> h, x & self._half_mask
        for r in range(ROUNDS):
            left, right = right, left ^ self._round(r, right)
        return (left << h) | right

    def _backward(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half_bits)
        left, right = x >> h, x & self._half_mask
        for r in reversed(range(ROUNDS)):
            left, right = right ^ self._round(r, left), left
        return (left << h) | right
