"""Read back what an offline W&B run recorded, without the network.

An offline run (``mode: offline`` or ``WANDB_MODE=offline``) writes everything it would
have sent to ``<run_dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb``: a transaction
log of protobuf records (W&B's ``Record``), framed the way LevelDB frames its log
(32 KiB blocks of checksummed chunks). ``wandb sync`` uploads that file later; this
module reads it so that a test, or a person on a machine without network, can see what
will be uploaded. wandb 0.31 ships no Python reader of its own (the internal
``datastore`` module went with the move to ``wandb-core``), hence this one.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import struct
import time
import zlib
from collections.abc import Iterator
from typing import Any

from wandb.proto import wandb_internal_pb2

_FILE_HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, format version
_CHUNK_HEADER = struct.Struct("<IHB")  # masked crc32c, length, chunk type
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclasses.dataclass
class OfflineRun:
    """What one ``.wandb`` file holds, decoded from JSON into Python values."""

    path: str
    run_id: str
    project: str
    name: str
    tags: list[str]
    git_commit: str
    """The commit recorded for the run's code ("" if none)."""
    history: list[dict[str, Any]]
    """One dict per ``run.log`` call, with its ``_step``."""
    config: dict[str, Any]
    """The config as last updated (``_wandb`` bookkeeping left out)."""
    summary: dict[str, Any]
    """The summary as last updated."""
    files: list[str]
    """Paths (relative to the run's ``files`` directory) the run asked to upload."""
    artifacts: list[dict[str, Any]]
    """``{"name", "type", "files"}`` for each artifact the run logged."""
    exit_code: int | None = None
    """The exit code the run was finished with (non-zero: W&B shows it failed); None if the
    file has no exit record (the run never finished)."""

    def steps(self, key: str) -> dict[int, Any]:
        """``{step: value}`` for every history row that has ``key``."""
        return {row["_step"]: row[key] for row in self.history if key in row}


def offline_run_files(run_dir: str, run_id: str | None = None) -> list[str]:
    """The ``.wandb`` files of the offline runs under ``run_dir/wandb`` (of ``run_id`` only,
    if given), oldest first: a resumed run adds one file per restart."""
    found = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    if run_id is not None:
        own = re.compile(rf"-{re.escape(run_id)}(-\d+)?$")
        found = [p for p in found if own.search(os.path.dirname(p))]
    return sorted(found, key=_creation_order)


def _creation_order(path: str) -> tuple:
    """``offline-run-<YYYYmmdd_HHMMSS>-<id>``, with ``-1``, ``-2``... appended by W&B when a
    second run of the same id starts within the same second: time first, then that suffix."""
    name = os.path.basename(os.path.dirname(path))
    stamp = name[len("offline-run-") :].split("-", 1)[0]
    return stamp, len(name), name


def read_offline_run(path: str) -> OfflineRun:
    """Decode the ``.wandb`` file at ``path``."""
    run = OfflineRun(path, "", "", "", [], "", [], {}, {}, [], [])
    for raw in _records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.run_id, run.project, run.name, run.tags = r.run_id, r.project, r.display_name, list(r.tags)
            run.git_commit = r.git.commit or run.git_commit
        elif kind == "environment":  # where wandb-core records the git state it saw
            run.git_commit = record.environment.git.commit or run.git_commit
            _apply(run.config, record.run.config.update)
        elif kind == "history":
            row: dict[str, Any] = {}
            _apply(row, record.history.item)
            run.history.append(row)
        elif kind == "config":
            _apply(run.config, record.config.update)
        elif kind == "summary":
            _apply(run.summary, record.summary.update)
        elif kind == "files":
            run.files.extend(f.path for f in record.files.files)
        elif kind == "artifact":
            a = record.artifact
            run.artifacts.append({"name": a.name, "type": a.type, "files": [e.path for e in a.manifest.contents]})
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    run.config.pop("_wandb", None)
    return run


def wait_until_written(path: str, timeout: float = 60.0) -> bool:
    """Wait until the ``.wandb`` file at ``path`` holds its run's exit record; False if it does
    not within ``timeout`` seconds. ``run.finish()`` returns before wandb-core has flushed
    the file (it writes from another process), so a reader right after it could find only
    the file header."""
    deadline = time.monotonic() + timeout
    while True:
        if os.path.exists(path):
            for raw in _records(path):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(raw)
                if record.WhichOneof("record_type") == "exit":
                    return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _apply(target: dict, items) -> None:
    """Set each ``key``/``nested_key`` item's JSON value in ``target``."""
    for item in items:
        keys = list(item.nested_key) or [item.key]
        node = target
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = json.loads(item.value_json)


def _records(path: str) -> Iterator[bytes]:
    """The records of a LevelDB-framed log: chunks never straddle a 32 KiB block (a block's
    last < 7 bytes are padding), and a record split across blocks comes as FIRST, MIDDLE...,
    LAST chunks."""
    with open(path, "rb") as f:
        data = f.read()
    ident, magic, _version = _FILE_HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path} is not a W&B transaction log (header {ident!r} {magic:#x})")
    pos, pending = _FILE_HEADER.size, b""
    while pos + _CHUNK_HEADER.size <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _CHUNK_HEADER.size:
            pos += room
            continue
        crc, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding: the writer stopped here
            break
        chunk = data[pos + _CHUNK_HEADER.size : pos + _CHUNK_HEADER.size + length]
        pos += _CHUNK_HEADER.size + length
        if len(chunk) < length or zlib.crc32(bytes([kind]) + chunk) != crc:
            break  # a chunk cut short (the run was killed mid-write) ends what can be read
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
