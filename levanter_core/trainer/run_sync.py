"""The run directory when ``trainer.log_dir`` is an object-store URL (``s3://``, ``gs://``).

What writes into a run directory writes ordinary local files: the run record, the ``json``
tracker's ``metrics.jsonl`` (appended to at every step), TensorBoard's event files, W&B's
offline run, the profiler's traces, heatmaps, evaluators' outputs. An object store can do
none of that (an object is replaced whole, never appended to or renamed), so when the log
directory is a URL they all write into a local mirror of the run directory,

    ``{tempfile.gettempdir()}/levanter-runs/{digest of log_dir}/{run_id}/``

(``TMPDIR`` moves it), and :class:`RunDirectorySync` copies the mirror to
``{log_dir}/{run_id}/``: each file that changed since its last upload, every
:data:`SYNC_INTERVAL_SECONDS` in a background thread, before each checkpoint is saved (so that
a run resumed from that checkpoint finds every step up to it in the stored ``metrics.jsonl``,
as the trackers are promised), and when the run ends, however it ends. Before anything is
written, the mirror is emptied and filled with what the URL holds, so a resumed run's trackers
carry on from the stored files exactly as they would from a local run directory.

Only process 0 writes the run directory, so only process 0 downloads and uploads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import posixpath
import shutil
import tempfile
import threading

from levanter_core.errors import ConfigError
from levanter_core.fileio import filesystem, is_local, join, normalize

logger = logging.getLogger(__name__)

SYNC_INTERVAL_SECONDS = 30.0
"""How often the background thread uploads what changed in a mirrored run directory."""

_SKIPPED_SUFFIX = ".partial"
"""Files being written by :func:`~levanter_core.fileio.write_text_atomically`, renamed over
their final name a moment later: never worth uploading."""


def mirror_directory(log_dir: str, run_id: str) -> str:
    """The local directory that stands in for ``{log_dir}/{run_id}`` (``log_dir`` a URL):
    under the temporary directory, named by a digest of the URL, so that runs of different
    log directories with the same run id do not share one."""
    digest = hashlib.sha256(normalize(log_dir).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), "levanter-runs", digest, run_id)


@dataclasses.dataclass
class RunDirectory:
    """Where a run's files are written (:attr:`path`, always local) and where they are kept
    (:attr:`location`: :attr:`path` itself, or the URL it is mirrored to)."""

    path: str
    """The local directory the run record, the trackers and every other writer use."""
    location: str
    """The run directory as the user named it: ``{trainer.log_dir}/{run_id}``."""
    sync: RunDirectorySync | None = None
    """What uploads :attr:`path` to :attr:`location` (process 0 of a run with a URL only)."""

    @classmethod
    def open(cls, log_dir: str, run_id: str, *, leader: bool) -> RunDirectory:
        """The run directory of ``run_id`` under ``log_dir``. A local ``log_dir`` is used as
        it is. Under a URL, process 0 (``leader``) fills the local mirror with what the URL
        holds already (a run being resumed) and starts uploading it in the background; the
        other processes get the mirror's path, whose files stay on their own machine. Raises
        :class:`ConfigError` if the URL cannot be read."""
        if is_local(log_dir):
            path = os.path.join(log_dir, run_id)
            return cls(path, path)
        location, path = join(normalize(log_dir), run_id), mirror_directory(log_dir, run_id)
        if not leader:
            return cls(path, location)
        sync = RunDirectorySync(path, location)
        try:
            sync.download()
        except Exception as e:
            raise ConfigError(f"trainer.log_dir: could not read the run directory {location}: {e}") from e
        sync.start()
        return cls(path, location, sync)

    @property
    def mirrored(self) -> bool:
        """Whether :attr:`path` is a local mirror of a URL."""
        return self.location != self.path

    def flush(self, *, required: bool = False) -> None:
        """Upload what changed now, waiting for it (before a checkpoint is saved). A failure is
        logged, not raised: the run goes on, and the next upload tries again. ``required``: raise
        it as a :class:`ConfigError` instead (the first upload, of the run record: a bucket that
        cannot be written stops the run before it trains)."""
        if self.sync is None:
            return
        try:
            self.sync.sync()
        except Exception as e:
            if required:
                self.sync.stop()
                self.sync = None
                raise ConfigError(f"trainer.log_dir: could not write the run directory {self.location}: {e}") from e
            logger.warning("could not upload the run directory %s to %s: %s", self.path, self.location, e)

    def close(self) -> None:
        """Stop uploading in the background and upload what is left. A failure is reported,
        naming the local directory that holds the files, but not raised: the run's checkpoints
        and exports do not depend on it, and an error raised here would hide the run's own."""
        if self.sync is None:
            return
        try:
            self.sync.close()
        except Exception as e:
            logger.error("could not upload the run directory %s to %s: %s", self.path, self.location, e)
            print(
                f"could not upload the last changes of the run directory to {self.location}: {e}\n"
                f"its files are in {self.path}; copy them there to complete it",
                flush=True,
            )
        self.sync = None


class RunDirectorySync:
    """Keeps the URL ``url`` a copy of the local directory ``local``, in which only this
    process writes: :meth:`sync` uploads each file that is new or changed (by size and
    modification time) since it was last uploaded, and deletes the stored copy of each file
    since removed; :meth:`start` does so every ``interval`` seconds in a background thread,
    until :meth:`close`, which syncs once more.

    Files are uploaded whole, one object each: a file being appended to is sent again in full
    at each sync in which it grew."""

    def __init__(self, local: str, url: str, *, interval: float = SYNC_INTERVAL_SECONDS):
        self.local = local
        self.url = url
        self.interval = interval
        self._fs, self._root = filesystem(url)
        self._root = self._root.rstrip("/")
        self._stored: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime) of the copy at the URL
        self._lock = threading.Lock()  # one sync at a time: the background thread's or a caller's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def download(self) -> int:
        """Empty the local directory and fill it with the files under the URL; returns how many
        there were (0 for a run that has none yet)."""
        with self._lock:
            shutil.rmtree(self.local, ignore_errors=True)
            os.makedirs(self.local, exist_ok=True)
            self._stored = {}
            self._fs.invalidate_cache(self._root)
            try:
                keys = self._fs.find(self._root)
            except FileNotFoundError:
                keys = []
            for key in keys:
                relative = posixpath.relpath(key, self._root)
                if relative == "." or relative.startswith("..") or key.endswith("/"):  # not a file below it
                    continue
                target = os.path.join(self.local, *relative.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                self._fs.get_file(key, target)
                self._stored[relative] = _stamp(target)
            return len(self._stored)

    def sync(self) -> None:
        """Upload what changed since the last sync, and delete the stored copies of files that
        are gone. Raises the first error; what was not uploaded is tried again next time."""
        with self._lock:
            present = self._local_files()
            for relative, stamp in present.items():
                if self._stored.get(relative) == stamp:
                    continue
                source = os.path.join(self.local, relative)
                try:
                    # The stamp is taken before the upload: a file that changes during it
                    # differs from its stamp afterwards and is sent again at the next sync.
                    self._fs.put_file(source, f"{self._root}/{relative}")
                except FileNotFoundError:
                    if os.path.exists(source):
                        raise  # the store's (a missing bucket), not a file removed meanwhile
                    continue
                self._stored[relative] = stamp
            for relative in [r for r in self._stored if r not in present]:
                with contextlib.suppress(FileNotFoundError):
                    self._fs.rm_file(f"{self._root}/{relative}")
                del self._stored[relative]

    def start(self) -> None:
        """Sync every ``interval`` seconds in a background thread, until :meth:`close`."""
        self._thread = threading.Thread(target=self._sync_periodically, name="levanter-run-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread (after the sync it may be in the middle of)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop the background thread and sync one last time (raising its error, if any)."""
        self.stop()
        self.sync()

    def _sync_periodically(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync()
            except Exception as e:  # a store out of reach for a while must not stop the run
                logger.warning("could not upload the run directory %s to %s: %s", self.local, self.url, e)

    def _local_files(self) -> dict[str, tuple[int, int]]:
        """Every regular file under the local directory (not links: W&B points ``latest-run``
        at its own directory), as ``relative/path -> (size, mtime)``."""
        found = {}
        for directory, _, names in os.walk(self.local):
            for name in names:
                path = os.path.join(directory, name)
                if name.endswith(_SKIPPED_SUFFIX) or os.path.islink(path):
                    continue
                try:
                    stamp = _stamp(path)
                except FileNotFoundError:  # removed since it was listed
                    continue
                found["/".join(os.path.relpath(path, self.local).split(os.sep))] = stamp
        return found


def _stamp(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns
