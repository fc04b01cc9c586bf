"""Building the next training batches on a background thread while the device trains."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import numpy as np


class Prefetcher:
    """Builds the next batches on a background thread while the device trains."""

    def __init__(self, make_batch: Callable[[int], np.ndarray], start: int, stop: int, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, args=(make_batch, start, stop), daemon=True)
        self._stopped = threading.Event()
        self._thread.start()

    def _run(self, make_batch, start, stop):
        for step in range(start, stop):
            if self._stopped.is_set():
                return
            item: tuple[int, np.ndarray | None, BaseException | None]
            try:
                item = (step, make_batch(step), None)
            except BaseException as e:  # surfaced to the training thread by get()
                item = (step, None, e)
            while not self._stopped.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def get(self) -> tuple[int, np.ndarray]:
        step, batch, error = self._queue.get()
        if error is not None:
            raise error
        return step, batch

    def close(self) -> None:
        self._stopped.set()
