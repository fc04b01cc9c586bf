"""The coordinator: builds one cache from a thread of the process that opened it. It hands the
unfinished shards to workers (:mod:`~levanter_core.data.cache.shard`), keeps the ledger from
their reports (its only writer), and wakes the readers waiting for more."""

from __future__ import annotations

import copy
import functools
import json
import logging
import threading
import time

from tqdm import tqdm

from levanter_core.data.cache.ledger import MAX_PROBLEMS, _no_documents
from levanter_core.data.cache.shard import _Job, tokenize_shard
from levanter_core.data.executor import BuildStopped, Progress, ShardTask, run_shards
from levanter_core.errors import DataError, UserError

# The package's logger, as before the split: log lines still name levanter_core.data.cache.
logger = logging.getLogger(__package__)

LEDGER_INTERVAL = 0.5
"""Least seconds between two ledger writes, except when a shard finishes or the build ends."""


class _Build:
    """Builds one cache: hands its unfinished shards to workers, keeps the ledger from their
    reports, and wakes readers waiting for more."""

    def __init__(
        self,
        path: str,
        storage,
        ledger: dict,
        job: _Job,
        *,
        num_workers: int,
        num_shard_groups: int | None,
        ray,
        progress: bool,
        in_process_below: int = 0,
    ):
        self.path = path
        self.condition = threading.Condition()
        self.ledger = ledger  # guarded by `condition`
        self.version = 0
        self.error: BaseException | None = None
        self.done = False
        self._storage = storage
        self._job = job
        self._num_workers = num_workers
        self._num_shard_groups = num_shard_groups
        self._ray = ray
        self._progress = progress
        self._in_process_below = in_process_below
        self._stop = threading.Event()
        self._last_write = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Build in a background thread."""
        self._thread = threading.Thread(target=self._run_in_background, name=f"cache {self.path}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the workers and wait for the coordinator to leave the ledger consistent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def run(self) -> None:
        """Build to completion here; raises the build's error."""
        tasks = [
            ShardTask(i, s["name"], s["records"], s["documents"], s["tokens"], dict(s["skipped"]))
            for i, s in enumerate(self.ledger["shards"])
            if not s["finished"]
        ]
        started, tokens_before = time.monotonic(), self.ledger["num_tokens"]
        bar = tqdm(
            total=len(self.ledger["shards"]),
            initial=len(self.ledger["shards"]) - len(tasks),
            desc=f"tokenizing {self.ledger['split']}",
            unit="shard",
            disable=not self._progress,
        )
        try:
            self._write_ledger(force=True)
            run_shards(
                functools.partial(tokenize_shard, self._job),
                tasks,
                lambda p: self._report(p, bar, started),
                num_workers=self._num_workers,
                max_groups=self._num_shard_groups,
                ray=self._ray,
                stop=self._stop,
                processes=self._storage.shared and not self._small(tasks),
            )
            with self.condition:
                if self.ledger["num_documents"] == 0:
                    raise _no_documents(self.path, self.ledger["split"], self.ledger)
                self.ledger["complete"] = True
        except BaseException as e:
            with self.condition:
                stopped = isinstance(e, BuildStopped)
                self.error = (
                    DataError(f"{self.path}: the cache build was stopped before it completed") if stopped else e
                )
            raise
        finally:
            bar.close()
            self._write_ledger(force=True)
            with self.condition:
                self.done = True
                self.version += 1
                self.condition.notify_all()
        seconds = time.monotonic() - started
        made = self.ledger["num_tokens"] - tokens_before
        logger.info(
            "built the cache %s: %d documents, %d tokens (%d new in %.1fs, %.3g tokens/s)",
            self.path,
            self.ledger["num_documents"],
            self.ledger["num_tokens"],
            made,
            seconds,
            made / max(seconds, 1e-9),
        )

    def _small(self, tasks: list[ShardTask]) -> bool:
        """Whether the unfinished shards are files the source sized, together under
        ``in_process_below`` bytes, and no Ray cluster tokenizes them: then threads here tokenize
        them, not worker processes that take longer to start than the work takes
        (``data.cache_options.in_process_below``)."""
        if self._ray is not None and self._ray.address:
            return False
        sizes = [self.ledger["shards"][task.index]["fingerprint"] for task in tasks]
        if not all(isinstance(fp, dict) and isinstance(fp.get("size"), int) for fp in sizes):
            return False
        total = sum(fp["size"] for fp in sizes)
        small = total < self._in_process_below
        if small:
            logger.debug("tokenizing %s (%d bytes) in this process", self.path, total)
        return small

    def _run_in_background(self) -> None:
        try:
            self.run()
        except BuildStopped:
            logger.info("stopped building the cache %s", self.path)
        except UserError:
            pass  # a problem with the data: every reader raises it, with its message
        except BaseException:
            logger.exception("building the cache %s failed", self.path)

    def _report(self, p: Progress, bar: tqdm, started: float) -> None:
        with self.condition:
            shard = self.ledger["shards"][p.index]
            shard.update(
                records=p.records, documents=p.documents, tokens=p.tokens, skipped=p.skipped, finished=p.finished
            )
            problems = self.ledger["problems"]
            problems.extend(p.problems[: MAX_PROBLEMS - len(problems)])
            self.ledger["num_documents"] = sum(s["documents"] for s in self.ledger["shards"])
            self.ledger["num_tokens"] = sum(s["tokens"] for s in self.ledger["shards"])
            self.version += 1
            self.condition.notify_all()
            docs, tokens = self.ledger["num_documents"], self.ledger["num_tokens"]
        self._write_ledger(force=p.finished)
        rate = tokens / max(time.monotonic() - started, 1e-9)
        bar.set_postfix(docs=docs, tokens=tokens, tokens_per_s=f"{rate:.3g}", refresh=False)
        bar.update(1 if p.finished else 0)

    def _write_ledger(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_write < LEDGER_INTERVAL:
            return
        with self.condition:
            self.ledger["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            text = json.dumps(self.ledger, indent=1)
        self._storage.write_ledger(text)
        self._last_write = now

    def snapshot(self) -> tuple[int, dict]:
        with self.condition:
            return self.version, copy.deepcopy(self.ledger)
