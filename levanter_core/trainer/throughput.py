"""Tokens per second of training, with the time spent on other things (evaluation, saving a
checkpoint) left out."""

from __future__ import annotations

import time


class Throughput:
    """Tokens per second over the steps since the first one (which includes compilation).

    A step's time runs from one :meth:`tick` to the next, less the time spent between
    :meth:`pause` and :meth:`resume` (evaluation, saving a checkpoint): only training counts,
    whichever way the ticks and the pauses interleave."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self._last: float | None = None
        self._paused_at: float | None = None
        self._paused = 0.0  # seconds paused since the last tick
        self.step_times: list[float] = []

    def pause(self) -> None:
        """Stop counting time until :meth:`resume`: what follows is not training."""
        if self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """Count time again."""
        if self._paused_at is not None:
            self._paused += time.perf_counter() - self._paused_at
            self._paused_at = None

    def tick(self) -> float | None:
        """Mark the end of a step; its tokens per second (None for the first tick, or for a step
        that took no time at all)."""
        now = time.perf_counter()
        if self._paused_at is not None:  # ticked while paused: the pause so far ends this step
            self._paused += now - self._paused_at
            self._paused_at = now
        rate = None
        if self._last is not None:
            dt = now - self._last - self._paused
            if dt > 0:
                self.step_times.append(dt)
                rate = self.tokens_per_step / dt
        self._last, self._paused = now, 0.0
        return rate
