"""``type: csv``: numeric metrics as a CSV table, one row per logged step.

The columns are ``step`` followed by every metric name seen so far, in the order the
names first appeared. A name that first appears at a later step (``eval/loss`` at the
first evaluation, say) extends the header: the file is rewritten with the new column,
left empty in the rows before. Only numbers are written; text and histograms are
skipped, since a spreadsheet cell cannot show them.

Two calls to ``log`` at the same step (the step's metrics, then a visualization's, say)
fill one row. When a run resumes from the checkpoint at step N, rows after N (written
before the interruption and about to be logged again) are dropped, so each step appears
once; a fresh start (no checkpoint) starts a new table.
"""

from __future__ import annotations

import csv
import io
import numbers
import os
from typing import Any

from pydantic import Field

from levanter_core.tracker import RunInfo, RunStatus, Tracker, TrackerConfig


class CsvTrackerConfig(TrackerConfig):
    """``type: csv``: numeric metrics as a CSV table, one row per logged step, columns named
    after the metrics (text and histograms are skipped)."""

    filename: str = Field("metrics.csv", min_length=1)
    """The CSV file, relative to the run directory (an absolute path is used as is)."""

    def init(self, run: RunInfo) -> Tracker:
        return CsvTracker(os.path.join(run.run_dir, self.filename), resume_step=run.resume_step)


class CsvTracker(Tracker):
    """Writes ``path``: a header line, then one line per logged step, flushed as it is logged."""

    def __init__(self, path: str, *, resume_step: int | None = None):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.columns: list[str] = ["step"]
        rows: list[dict[str, str]] = []
        if resume_step is not None and os.path.exists(path):
            self.columns, rows = _read_table(path)
            rows = [row for row in rows if int(row["step"]) <= resume_step]
        self._file: io.TextIOWrapper | None = None
        self._last_row: dict[str, Any] | None = None  # the newest row, which a same-step log extends
        self._last_offset = 0  # where the newest row starts in the file
        self._rewrite(rows)

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        row = {name: value for name, value in metrics.items() if _is_number(value)}
        if not row or self._file is None:
            return
        row = {"step": int(step), **row}
        extending = self._last_row is not None and int(self._last_row["step"]) == row["step"]
        if extending:
            row = {**self._last_row, **row}
        new_names = [name for name in row if name not in self.columns]
        if new_names:
            self.columns += new_names
            earlier = _read_table(self.path)[1]
            self._rewrite((earlier[:-1] if extending else earlier) + [row])
            return
        if extending:
            self._file.seek(self._last_offset)
            self._file.truncate()
        self._append(row)

    def finish(self, status: RunStatus = "success") -> None:
        # Every row is on disk already, however the run ended: a failed run's table is
        # complete up to its last logged step, which is what a reader of the file needs.
        if self._file is not None:
            self._file.close()
            self._file = None

    def _append(self, row: dict[str, Any]) -> None:
        self._last_offset = self._file.tell()
        csv.DictWriter(self._file, self.columns).writerow({name: _cell(value) for name, value in row.items()})
        self._file.flush()
        self._last_row = row

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        """Replace the file with the current header and ``rows``, then reopen it for appending.
        Written beside it and renamed, so that a kill mid-rewrite leaves the old table whole."""
        if self._file is not None:
            self._file.close()
        partial = f"{self.path}.partial"
        with open(partial, "w", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, self.columns).writeheader()
        os.replace(partial, self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._last_row = None
        for row in rows:
            self._append(row)


def _is_number(value: Any) -> bool:
    """Python and NumPy ints and floats; not text, histograms, or anything else."""
    return isinstance(value, numbers.Real)


def _cell(value: Any) -> str:
    """A number as CSV text that reads back to the same value (``repr`` of a float is exact);
    text read back from an existing file is kept as it was."""
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return str(int(value))
    return repr(float(value))


def _read_table(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """The header and the complete rows of a table this tracker wrote. A last line without its
    newline (the run was killed while writing it) and rows without a step are left out."""
    with open(path, newline="", encoding="utf-8") as f:
        text = f.read()
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text))
    columns = list(reader.fieldnames or [])
    if "step" not in columns:
        return ["step"], []
    rows = [{k: v for k, v in row.items() if v not in (None, "")} for row in reader if (row["step"] or "").isdigit()]
    return columns, rows
