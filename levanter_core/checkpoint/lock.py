"""One trainer per run: a lock in the run's checkpoint directory.

Two trainers started on the same run (the same ``trainer.id`` and ``base_path``) would both
write ``step-N`` checkpoints, each removing the other's unfinished saves as debris. So process
0 of a run takes the run's lock before it touches anything there, and a second trainer stops
with exit status 2, naming the host and process that hold it.

The lock is a small JSON file (an object on ``s3://`` or ``gs://``) in the checkpoint directory,
``{base_path}/{run_id}/LOCK.<generation>``::

    {"host": "node-3", "pid": 41822, "started": "2026-11-27T10:01:02+00:00",
     "heartbeat": 1796205662.5, "process_start": 1234567, "token": "9f2c..."}

* **Taking it** creates the file of the next generation (one more than the highest there),
  only if it does not exist yet: ``O_EXCL`` on a local disk, a conditional put on an object
  store (``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS). Of two trainers that
  try at once, exactly one creates it; the other looks again and finds it held.
* **Holding it**, a background thread rewrites the ``heartbeat`` (seconds since the epoch)
  every ``heartbeat_seconds``.
* **A stale lock** is one whose holder is gone: on this host, its process is not running (or
  its pid now belongs to a process started later); on another host, its heartbeat is older
  than ``stale_seconds``. A stale lock is taken over by creating the next generation, which
  is as safe as taking a free one; the older generations are then removed.
* **Releasing it** (the run ends, however it ends short of a kill) deletes the file.

A run killed with ``kill -9`` leaves its lock behind; the same command, on the same host, takes
it over at once. On another host it waits for the heartbeat to age: the message says how long.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import secrets
import socket
import threading
import time

from levanter_core import distributed, fileio
from levanter_core.errors import CheckpointError
from levanter_core.fileio import is_local, join

logger = logging.getLogger(__name__)

LOCK_PREFIX = "LOCK."
_LOCK_NAME = re.compile(r"^LOCK\.(\d+)$")
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 300.0


class RunInUseError(CheckpointError):
    """Another trainer holds the run's lock: two trainers must not write one run's checkpoints."""


class RunLock:
    """The lock of the run whose checkpoints go to ``directory`` (see the module docstring).
    :meth:`acquire` takes it or raises :class:`RunInUseError`; :meth:`release` lets it go. Also
    a context manager."""

    def __init__(
        self, directory: str, *, heartbeat_seconds: float = HEARTBEAT_SECONDS, stale_seconds: float = STALE_SECONDS
    ):
        self.directory = fileio.normalize(directory)
        self.heartbeat_seconds = heartbeat_seconds
        self.stale_seconds = stale_seconds
        self.path: str | None = None  # the lock file, while held
        self._record: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, over a stale one if need be; raise :class:`RunInUseError` naming the
        holder if a live trainer has it, and :class:`CheckpointError` if the directory cannot
        be written."""
        if is_local(self.directory):
            try:
                os.makedirs(fileio.local_path(self.directory), exist_ok=True)
            except OSError as e:
                raise self._cannot_write(e) from None
        for _ in range(20):  # each turn loses only to a trainer that took the lock meanwhile
            generation, held = self._newest()
            if held is not None:
                path, record = held
                if record is not None and not self._stale(record):
                    raise self._in_use(path, record)
                self._say_taken_over(path, record)
            record = self._new_record()
            path = join(self.directory, f"{LOCK_PREFIX}{generation + 1}")
            if self._create(path, record):
                self.path, self._record = path, record
                self._remove_older(generation + 1)
                self._thread = threading.Thread(target=self._beat, name="levanter-run-lock", daemon=True)
                self._thread.start()
                return
        raise CheckpointError(f"could not take the run's lock in {self.directory}: other trainers kept taking it")

    def release(self) -> None:
        """Stop the heartbeat and delete the lock file (nothing if not held)."""
        if self.path is None or self._record is None:  # not held (acquire sets both together)
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        path, self.path = self.path, None
        try:
            if self._read(path).get("token") == self._record["token"]:  # still ours
                _remove(path)
        except (OSError, ValueError) as e:
            logger.warning("could not remove the run's lock %s: %s", path, e)

    # -- the lock files ----------------------------------------------------------------------

    def _newest(self) -> tuple[int, tuple[str, dict | None] | None]:
        """The highest generation in the directory (-1 if none) and, if there is one, its path
        and content (None: unreadable, e.g. cut short by a kill as it was written)."""
        generations = [int(m.group(1)) for name in fileio.list_names(self.directory) if (m := _LOCK_NAME.match(name))]
        if not generations:
            return -1, None
        generation = max(generations)
        path = join(self.directory, f"{LOCK_PREFIX}{generation}")
        for attempt in range(3):
            try:
                return generation, (path, self._read(path))
            except FileNotFoundError:  # released meanwhile
                return generation, None
            except (OSError, ValueError):
                # empty or partial: being written by a trainer that created it an instant ago
                # (locally, creating and writing are two steps), or left so by a kill
                time.sleep(0.2 * (attempt + 1))
        return generation, (path, None)

    @staticmethod
    def _read(path: str) -> dict:
        record = json.loads(fileio.read_bytes(path))
        if not isinstance(record, dict):
            raise ValueError(f"{path} is not a lock record")
        return record

    def _create(self, path: str, record: dict) -> bool:
        """Create ``path`` holding ``record`` if it does not exist yet; whether this did."""
        data = json.dumps(record).encode("utf-8")
        try:
            if is_local(path):
                fd = os.open(fileio.local_path(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            else:
                fs, inner = fileio.filesystem(path)
                fs.pipe_file(inner, data, mode="create")
        except FileExistsError:  # also what s3fs and gcsfs raise when the put's condition fails
            return False
        except Exception as e:  # OSError locally; an object store's client raises its own errors too
            raise self._cannot_write(e) from None
        return True

    def _remove_older(self, generation: int) -> None:
        for name in fileio.list_names(self.directory):
            match = _LOCK_NAME.match(name)
            if match and int(match.group(1)) < generation:
                try:
                    _remove(join(self.directory, name))
                except OSError as e:  # housekeeping only: the newest generation is what counts
                    logger.warning("could not remove the old lock %s: %s", name, e)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            path, record = self.path, self._record
            if path is None or record is None:
                return
            try:
                current = self._read(path)
                if current.get("token") != record["token"]:
                    logger.error(
                        "the run's lock %s was taken over by %s: two trainers may be writing", path, _holder(current)
                    )
                    return
                record["heartbeat"] = time.time()
                fileio.write_text(path, json.dumps(record))
            except Exception as e:  # a store that is briefly unreachable: try again at the next beat
                logger.warning("could not renew the run's lock %s: %s", path, e)

    # -- who holds it ------------------------------------------------------------------------

    @staticmethod
    def _new_record() -> dict:
        now = time.time()
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": _process_start(os.getpid()),
            "started": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(timespec="seconds"),
            "heartbeat": now,
            "token": secrets.token_hex(8),
        }

    def _stale(self, record: dict) -> bool:
        """Whether the holder of ``record`` is gone."""
        if record.get("host") == socket.gethostname():
            pid = record.get("pid")
            return not isinstance(pid, int) or not _running(pid, record.get("process_start"))
        heartbeat = record.get("heartbeat")
        return not isinstance(heartbeat, (int, float)) or time.time() - heartbeat > self.stale_seconds

    def _say_taken_over(self, path: str, record: dict | None) -> None:
        if record is None:
            why = "it cannot be read"
        elif record.get("host") == socket.gethostname():
            why = f"process {record.get('pid')} is no longer running"
        else:
            why = f"its heartbeat is {time.time() - record.get('heartbeat', 0):.0f} s old"
        message = f"taking over the run's lock {path} from {_holder(record)}: {why}"
        logger.warning(message)
        print(message, flush=True)

    def _in_use(self, path: str, record: dict) -> RunInUseError:
        age = time.time() - record.get("heartbeat", time.time())
        if record.get("host") == socket.gethostname():
            gone = "If it is stuck, stop it; the next start takes the lock over once the process has exited."
        else:
            gone = (
                f"If it is no longer running, its lock is taken over once its heartbeat is {self.stale_seconds:.0f} s "
                f"old (in about {max(0.0, self.stale_seconds - age):.0f} s), or delete {path} now."
            )
        return RunInUseError(
            f"another trainer is running this run: {_holder(record)} holds its lock {path} "
            f"(started {record.get('started', '?')}, last heartbeat {age:.0f} s ago). Two trainers on one run would "
            f"overwrite each other's checkpoints, so this one stops. Wait for that one to finish, or give this run "
            f"another trainer.id. {gone}"
        )

    def _cannot_write(self, error: Exception) -> CheckpointError:
        reason = (error.strerror if isinstance(error, OSError) else None) or f"{type(error).__name__}: {error}"
        return CheckpointError(
            f"cannot write checkpoints to {self.directory}: {reason}. "
            "Set trainer.checkpointer.base_path to a writable directory or bucket."
        )


def _holder(record: dict | None) -> str:
    if record is None:
        return "an unknown trainer"
    return f"process {record.get('pid', '?')} on host {record.get('host', '?')}"


def _remove(path: str) -> None:
    fs, inner = fileio.filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(inner)


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux; None elsewhere): with
    the pid, it tells a process from a later one that was given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[19])  # field 22 of the line; state is field 3


def _running(pid: int, started: int | None) -> bool:
    """Whether process ``pid`` (started at ``started``, if known) is running on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc: the pid's existence is all there is to go on
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # killed, not yet reaped by its parent
        return False
    return started is None or int(fields[19]) == started


def hold_run_lock(directory: str) -> RunLock | None:
    """Take the lock of the run whose checkpoints go to ``directory``, in process 0, before the
    run touches anything there; every process stops with the same error if it is held. Returns
    the lock to release (None in the other processes)."""
    lock, refusal = None, {}
    if distributed.is_leader():
        lock = RunLock(directory)
        try:
            lock.acquire()
        except CheckpointError as e:
            lock, refusal = None, {"message": str(e), "in_use": isinstance(e, RunInUseError)}
        outcome = json.loads(distributed.share("run_lock", json.dumps(refusal)))
    else:
        outcome = json.loads(distributed.share("run_lock"))
    if outcome:
        raise (RunInUseError if outcome["in_use"] else CheckpointError)(outcome["message"])
    return lock
