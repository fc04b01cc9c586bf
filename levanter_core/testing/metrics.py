"""Reading what a run logged: its ``metrics.jsonl``, one JSON record a line, each with its
``step``.

A test reads a run's records with :func:`read_metrics` and a series (the training loss by
step) with :func:`logged`. Both take the run's directory: ``RunResult.run_dir``, or
``<log_dir>/<run id>`` for a run started in a subprocess.
"""

from __future__ import annotations

import json
import os
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str | os.PathLike, *, key: str | None = None, missing_ok: bool = False) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl`` in the order they were written; with ``key``,
    only those that hold it. A last line without its newline (a write cut short by a kill) is
    left out. A missing file raises ``FileNotFoundError``, or reads as no records with
    ``missing_ok``."""
    path = os.path.join(run_dir, METRICS_FILE)
    if missing_ok and not os.path.exists(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.endswith("\n")]
    return [r for r in records if key in r] if key is not None else records


def logged(
    run_dir: str | os.PathLike, key: str = "train/loss", *, once: bool = False, missing_ok: bool = False
) -> dict[int, Any]:
    """``step -> value`` of ``key`` in ``run_dir/metrics.jsonl`` (see :func:`read_metrics`). A
    step logged again (trained again after a resume) keeps its last value; with ``once``, a step
    logged twice fails the test instead, naming the step and the file."""
    values: dict[int, Any] = {}
    for record in read_metrics(run_dir, key=key, missing_ok=missing_ok):
        step = record["step"]
        assert not (once and step in values), f"step {step} logged twice in {os.path.join(run_dir, METRICS_FILE)}"
        values[step] = record[key]
    return values
