"""Who tokenizes the shards of a cache: local worker processes, or Ray tasks.

The coordinator (a thread of the process building the cache, see :mod:`.cache`) calls
:func:`run_shards` with a *work* function and the unfinished shards. Work for one shard
is a generator of :class:`Progress` reports, each sent after the data it counts is
stored. Shards go out in index order, so the ready prefix of the cache grows early;
they may finish out of order. Every report comes back to the coordinator's thread.

The shards are handed out in at most ``data.cache_options.num_shard_groups`` *groups* of
consecutive shards (None: one group per shard): a group is one unit of work, a Ray task or
one take from a local worker's queue, whose shards are tokenized one after the other. Fewer
groups mean fewer, longer tasks (less scheduling on a cluster with many small files); how
many run at once is still ``data.num_workers`` locally, the cluster's CPUs on Ray.

* Local: ``num_workers`` processes from a *spawn* context (the caller may have JAX
  loaded, which must never be forked), fed shards from a queue. A cache in this
  process's memory (``memory://``) is built by threads instead: other processes
  cannot see it.
* Ray: with ``trainer.ray.address`` set (``local``, ``auto`` or ``host:port``), each
  group of shards is a streaming Ray task whose reports are its yielded values. Tasks are spread
  over the cluster's nodes; each first reports which node runs it, and the build logs how
  many shards each node tokenized (never in the ledger, which stays the same wherever the
  shards ran).

A worker that raises or dies fails the whole build; :func:`run_shards` raises its
error. Nothing waits forever.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import os
import queue
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from levanter_core.distributed.ray_cluster import check_reachable
from levanter_core.errors import DataError, UserError

if TYPE_CHECKING:
    import multiprocessing.process
    import multiprocessing.queues
    import multiprocessing.synchronize

    _Worker = multiprocessing.process.BaseProcess | threading.Thread  # a local worker: a process or a thread

logger = logging.getLogger(__name__)

_POLL = 0.2  # seconds between checks for a stop request or a dead worker


@dataclasses.dataclass(frozen=True)
class ShardTask:
    """One shard to tokenize, from its resume point (the ledger's counts)."""

    index: int
    name: str
    records: int
    documents: int
    tokens: int
    skipped: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Progress:
    """A shard's counts so far (from its start, resumed runs included); everything counted
    is stored. ``problems``: messages of records skipped since the previous report."""

    index: int
    records: int
    documents: int
    tokens: int
    skipped: dict[str, int]
    problems: list[str]
    finished: bool


class BuildStopped(Exception):
    """The build was asked to stop (``TokenCache.close()``) before it finished."""


Work = Callable[[ShardTask], Iterator[Progress]]


def shard_groups(tasks: list[ShardTask], max_groups: int | None) -> list[list[ShardTask]]:
    """``tasks`` (in index order) as at most ``max_groups`` runs of consecutive tasks, as even
    in length as they can be, longer ones first; None: one group per task."""
    if max_groups is None or max_groups >= len(tasks):
        return [[task] for task in tasks]
    size, extra = divmod(len(tasks), max_groups)
    groups, start = [], 0
    for g in range(max_groups):
        stop = start + size + (1 if g < extra else 0)
        groups.append(tasks[start:stop])
        start = stop
    return groups


def run_shards(
    work: Work,
    tasks: list[ShardTask],
    report: Callable[[Progress], None],
    *,
    num_workers: int,
    max_groups: int | None = None,
    ray=None,
    stop: threading.Event,
    processes: bool = True,
) -> None:
    """Run ``work`` on every task and call ``report`` (in this thread) with each report.
    Returns when every shard is finished; raises the first worker error, or
    :class:`BuildStopped` soon after ``stop`` is set. ``max_groups``: the tasks go out in at
    most this many groups of consecutive shards (:func:`shard_groups`). ``ray``: a
    ``RayConfig``, used when it has an ``address``. ``processes=False``: local workers are
    threads of this process."""
    if not tasks:
        return
    groups = shard_groups(tasks, max_groups)
    if ray is not None and ray.address:
        if not processes:
            raise DataError("a cache kept in this process's memory (memory://) cannot be built by Ray workers")
        _run_ray(work, groups, report, ray.address, stop)
    else:
        _run_local(work, groups, report, num_workers, stop, processes)


# -- local processes --------------------------------------------------------------------------


def _serve(
    work: Work, todo, results, halt, own_process: bool, threads: int | None = None, coordinator: int | None = None
) -> None:
    """A worker's life: take shards until the queue's end marker, sending every report.

    ``threads``: the cores this process may use. The Rust ``tokenizers`` library encodes a
    batch on every core by default; several workers doing that would only contend.
    ``coordinator``: the pid of the process that started this one (a worker process's)."""
    if own_process:
        # The coordinator's pid comes from the coordinator: a spawned worker takes a second to
        # import, and if the coordinator was killed meanwhile, os.getppid() is already another
        # process's (init's), which the watchdog would wait on forever while this orphan wrote.
        if os.getppid() != coordinator:
            os._exit(1)
        threading.Thread(target=_exit_with_parent, args=(coordinator,), daemon=True).start()
        if threads is not None:
            os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    while not halt.is_set():
        group = todo.get()
        if group is None:
            return
        for task in group:
            try:
                for progress in work(task):
                    if halt.is_set():
                        return
                    results.put(("progress", progress))
                results.put(("done", task.index))
            except BaseException as e:  # reaches the coordinator, which fails the build
                results.put(("error", _portable(e, task)))
                return


def _exit_with_parent(parent: int) -> None:
    """End this worker process as soon as the coordinator's process is gone (killed), so no
    orphan keeps writing while a restarted build resumes the same shards."""
    while os.getppid() == parent:
        time.sleep(0.05)
    os._exit(1)


def _portable(error: BaseException, task: ShardTask) -> BaseException:
    """``error`` in a form that survives pickling: a :class:`UserError` as it is (its
    message is for people), anything else as its traceback."""
    if isinstance(error, UserError):
        return error
    return RuntimeError(
        f"tokenizing shard {task.index} ({task.name}) failed:\n{''.join(traceback.format_exception(error))}"
    )


def _run_local(
    work: Work, groups: list[list[ShardTask]], report, num_workers: int, stop: threading.Event, processes: bool
) -> None:
    count = min(num_workers, len(groups))
    # Processes and their queues, or threads and theirs: the same methods either way.
    todo: queue.Queue[Any] | multiprocessing.queues.Queue[Any]
    results: queue.Queue[Any] | multiprocessing.queues.Queue[Any]
    halt: threading.Event | multiprocessing.synchronize.Event
    workers: list[_Worker]
    if processes:
        context = multiprocessing.get_context("spawn")
        todo, results, halt = context.Queue(), context.Queue(), context.Event()
        threads = max(1, (os.cpu_count() or 1) // count)
        workers = [
            context.Process(target=_serve, args=(work, todo, results, halt, True, threads, os.getpid()), daemon=True)
            for _ in range(count)
        ]
    else:
        todo, results, halt = queue.Queue(), queue.Queue(), threading.Event()
        workers = [
            threading.Thread(target=_serve, args=(work, todo, results, halt, False), daemon=True) for _ in range(count)
        ]
    for group in groups:  # in index order: the first shards go out first
        todo.put(group)
    for _ in workers:
        todo.put(None)
    for worker in workers:
        worker.start()
    remaining = sum(len(group) for group in groups)
    try:
        while remaining:
            if stop.is_set():
                raise BuildStopped()
            try:
                kind, payload = results.get(timeout=_POLL)
            except queue.Empty:
                _check_alive(workers)
                continue
            if kind == "progress":
                report(payload)
            elif kind == "done":
                remaining -= 1
            else:
                raise payload
    finally:
        halt.set()
        _end(workers, wait=remaining == 0)


def _check_alive(workers: Sequence[_Worker]) -> None:
    for worker in workers:
        code = getattr(worker, "exitcode", None)
        if code:  # a process that exited with an error before it could report one (killed, out of memory)
            raise RuntimeError(f"a tokenizer worker process died (exit code {code}) before finishing its shard")


def _end(workers: Sequence[_Worker], wait: bool) -> None:
    """Let finished workers exit; terminate processes that are still busy."""
    for worker in workers:
        worker.join(timeout=10 if wait else 0.5)
        if worker.is_alive() and hasattr(worker, "terminate"):
            worker.terminate()
            worker.join()


# -- Ray --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RanOn:
    """The Ray node a shard's task runs on: the first value the task streams back."""

    node_id: str
    host: str

    def __str__(self) -> str:
        return f"{self.host} [{self.node_id[:8]}]"


def _stream(work: Work, group: list[ShardTask]) -> Iterator[RanOn | Progress]:
    """A Ray task's body: where it runs, then its shards' reports, as the values it streams back."""
    import ray

    yield RanOn(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
    for task in group:
        yield from work(task)


_RAY_INIT = threading.Lock()  # the caches of a run are built by concurrent coordinator threads


def connect(ray) -> None:
    """Join (or start) the Ray cluster of ``ray`` (a ``RayConfig``) if it names one. Call it
    from the thread that outlives the builds (the main thread): a private Ray instance's
    processes are tied to the thread that started them and die with it."""
    if ray is not None and ray.address:
        _connect(ray.address)


def _connect(address: str) -> None:
    import ray

    with _RAY_INIT, warnings.catch_warnings():
        # Starting Ray's own processes goes through fork + exec (subprocess), which JAX's
        # fork warning cannot tell from a bare fork; nothing of this process runs in them.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        if ray.is_initialized():
            return
        if address == "local":  # a new private instance, never a cluster found on this machine
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
        else:
            if address != "auto":
                check_reachable(address)  # Ray would retry an unreachable address for minutes
            ray.init(address=address, log_to_driver=False)


def _run_ray(work: Work, groups: list[list[ShardTask]], report, address: str, stop: threading.Event) -> None:
    import ray
    from ray.exceptions import RayTaskError

    _connect(address)
    # SPREAD: the shards go round the nodes rather than filling the driver's node first.
    stream = ray.remote(num_returns="streaming", max_retries=0, scheduling_strategy="SPREAD")(_stream)
    # No more tasks in flight than CPUs, so they start in index order.
    capacity = max(1, int(ray.cluster_resources().get("CPU", 1)))
    pending = list(groups)
    running: dict = {}
    nodes: dict = {}  # generator -> the node running it
    shards_by_node: collections.Counter[str] = collections.Counter()
    try:
        while pending or running:
            while pending and len(running) < capacity:
                group = pending.pop(0)
                running[stream.remote(work, group)] = group
            if stop.is_set():
                raise BuildStopped()
            ready, _ = ray.wait(list(running), num_returns=1, timeout=_POLL)
            for done in ready:
                # ray.wait is annotated for object refs; what it returns here are the tasks' streams.
                generator = cast("ray.ObjectRefGenerator", done)
                try:
                    value = ray.get(next(generator))
                except StopIteration:
                    shards_by_node[str(nodes.pop(generator))] += len(running.pop(generator))
                    continue
                except RayTaskError as e:
                    raise (e.cause if isinstance(e.cause, UserError) else e) from None
                if isinstance(value, RanOn):
                    nodes[generator] = value
                else:
                    report(value)
    finally:
        for generator in running:
            ray.cancel(generator, force=True)
    logger.info(
        "tokenized %d shards on %d Ray nodes in %d tasks (%s)",
        sum(len(group) for group in groups),
        len(shards_by_node),
        len(groups),
        ", ".join(f"{node}: {count}" for node, count in sorted(shards_by_node.items())),
        extra={"shards_by_node": dict(shards_by_node)},
    )
