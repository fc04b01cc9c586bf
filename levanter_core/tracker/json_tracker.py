"""``type: json``: metrics as JSON lines in the run directory.

``metrics.jsonl`` gets one object per logged step, ``{"step": N, "train/loss": ...}``;
``summary.json`` the end-of-run summary; ``hparams.json`` the configuration.
When a run resumes from step N, lines for steps after N (written before the
interruption and about to be recomputed) are dropped, so each step appears once.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any

from levanter_core.fileio import write_text_atomically
from levanter_core.tracker.base import Histogram, RunInfo, RunStatus, Tracker, TrackerConfig


class JsonTrackerConfig(TrackerConfig):
    """Write metrics to JSON-lines files in the run directory."""

    filename: str = "metrics.jsonl"
    """Name of the metrics file inside the run directory."""

    def init(self, run: RunInfo) -> Tracker:
        return JsonTracker(run.run_dir, self.filename, resume_step=run.resume_step)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than invalid
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return value


class JsonTracker(Tracker):
    def __init__(self, run_dir: str, filename: str = "metrics.jsonl", *, resume_step: int | None = None):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, filename)
        os.makedirs(run_dir, exist_ok=True)
        self._drop_steps_after(resume_step or 0)
        self._file = open(self.path, "a", encoding="utf-8")

    def _drop_steps_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        kept = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a kill
                    continue
                if record.get("step", 0) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        write_text_atomically(self.path, "".join(kept))

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        # Numbers and text; histograms are for trackers that can draw them.
        kept = {k: v for k, v in metrics.items() if not isinstance(v, Histogram)}
        record = {"step": int(step), **{k: _jsonable(v) for k, v in kept.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log_summary(self, metrics: dict[str, Any]) -> None:
        self._write_json("summary.json", {k: _jsonable(v) for k, v in metrics.items()})

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        self._write_json("hparams.json", hparams)

    def log_artifact(self, path: str, *, name: str | None = None, type: str | None = None) -> None:
        run_dir = os.path.abspath(self.run_dir)
        if os.path.abspath(path).startswith(run_dir + os.sep):
            return  # already in the run directory
        target = os.path.join(run_dir, "artifacts", name or os.path.basename(path))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.isdir(path):
            shutil.copytree(path, target, dirs_exist_ok=True)
        else:
            shutil.copy2(path, target)

    def finish(self, status: RunStatus = "success") -> None:
        if not self._file.closed:
            self._file.close()

    def _write_json(self, name: str, obj: Any) -> None:
        write_text_atomically(os.path.join(self.run_dir, name), json.dumps(obj, indent=2, default=str))
