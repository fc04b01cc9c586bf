"""``type: tensorboard``: a run's metrics, config, summary and artifacts as TensorBoard event files.

Events are written with tensorboardX's ``SummaryWriter`` into one directory per run, so
``tensorboard --logdir`` on the parent directory lists every run by name:

- numbers -> scalars, :class:`~levanter_core.tracker.Histogram` -> histograms,
  ``str`` -> text, each under the metric's own name (``train/loss``);
- the resolved config -> the text ``config`` (as YAML) and the HParams dashboard
  (one hyperparameter per leaf, named by its dotted path: ``trainer.num_train_steps``);
- the end-of-run summary -> scalars and text under ``summary/``;
- artifacts -> text under ``artifacts/``: a text file's contents, otherwise where it is;
- how the run ended -> the HParams dashboard's Status column (success, or failure for a run
  that failed or was interrupted).

A resumed run (``RunInfo.resume_step = N``) writes into the same directory and marks
its start at step N + 1, so TensorBoard hides what the interrupted attempt logged after
step N (and which this attempt logs again) instead of drawing those steps twice.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import re
import time
from typing import Any

import numpy as np
import yaml
from pydantic import Field
from tensorboardX import SummaryWriter
from tensorboardX.proto.api_pb2 import Status
from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData, SessionEndInfo
from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboardX.summary import hparams as hparams_summaries

from levanter_core.tracker import Histogram, RunInfo, RunStatus, Tracker, TrackerConfig

logger = logging.getLogger(__name__)

# A text artifact larger than this is pointed to rather than copied into the event file.
MAX_TEXT_ARTIFACT_BYTES = 256 * 1024


class TensorboardConfig(TrackerConfig):
    """Write TensorBoard event files (view them with ``tensorboard --logdir DIR``)."""

    logdir: str | None = None
    """Directory holding one sub-directory of event files per run, ``{logdir}/{run_id}``; a
    relative path is relative to the working directory. Unset: the run directory's
    ``tensorboard/`` sub-directory (``{trainer.log_dir}/{run_id}/tensorboard``)."""

    flush_secs: int = Field(default=30, gt=0)
    """Write pending events to disk at least this often, in seconds (they are also written
    when ten are queued and when the run ends)."""

    def event_dir(self, run: RunInfo) -> str:
        """The directory this run's event files go to."""
        if self.logdir is None:
            return os.path.join(run.run_dir, "tensorboard")
        return os.path.join(os.path.abspath(self.logdir), run.run_id)

    def init(self, run: RunInfo) -> Tracker:
        return TensorboardTracker(self.event_dir(run), resume_step=run.resume_step, flush_secs=self.flush_secs)


class TensorboardTracker(Tracker):
    """Writes everything it is given to one TensorBoard run directory."""

    def __init__(self, event_dir: str, *, resume_step: int | None = None, flush_secs: int = 30):
        self.event_dir = event_dir
        # Events from the interrupted attempt at steps >= purge_step are hidden by TensorBoard.
        purge_step = None if resume_step is None else resume_step + 1
        # tensorboardX names event files by the second they were opened and would overwrite the
        # file of an attempt started in the same second; the nanosecond suffix keeps both, in
        # the order TensorBoard must read them (by name).
        self._writer = SummaryWriter(
            event_dir,
            purge_step=purge_step,
            flush_secs=flush_secs,
            filename_suffix=f".{time.time_ns()}",
        )
        # The step that the config, summary and artifacts are filed under: the last step
        # logged, or before any, the first step this attempt will log.
        self._step = purge_step or 0
        self._skipped: set[str] = set()
        self._closed = False

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        step = int(step)
        self._step = max(self._step, step)
        for name, value in metrics.items():
            self._write_value(name, value, step)

    def log_summary(self, metrics: dict[str, Any]) -> None:
        for name, value in metrics.items():
            self._write_value(f"summary/{name}", value, self._step)

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        self._writer.add_text(
            "config",
            _code_block(yaml.safe_dump(hparams, sort_keys=False), "yaml"),
            self._step,
        )
        flat = flatten_hparams(hparams)
        if not flat:
            return
        # Only the session-start record: TensorBoard's HParams dashboard then builds its table
        # from every run's hyperparameters and offers all scalars (train/loss...) as metrics.
        # tensorboardX's add_hparams would put them in a separate run directory instead.
        _experiment, session_start, _session_end = hparams_summaries(flat, {})
        self._writer.file_writer.add_summary(session_start, self._step)

    def log_artifact(self, path: str, *, name: str | None = None, type: str | None = None) -> None:
        name = name or os.path.basename(os.path.normpath(path))
        self._writer.add_text(f"artifacts/{name}", describe_artifact(path, type), self._step)

    def finish(self, status: RunStatus = "success") -> None:
        if not self._closed:
            self._closed = True
            self._writer.file_writer.add_summary(_session_end(status), self._step)
            self._writer.flush()
            self._writer.close()

    def _write_value(self, tag: str, value: Any, step: int) -> None:
        if isinstance(value, Histogram):
            self._write_histogram(tag, value, step)
        elif isinstance(value, str):
            self._writer.add_text(tag, value, step)
        elif _is_number(value):
            self._writer.add_scalar(tag, float(value), step)
        elif tag not in self._skipped:
            self._skipped.add(tag)
            logger.warning(
                "tensorboard tracker: %s is a %s, which it cannot show; skipped",
                tag,
                type(value).__name__,
            )

    def _write_histogram(self, tag: str, hist: Histogram, step: int) -> None:
        # TensorBoard stores each bucket by its upper edge.
        self._writer.add_histogram_raw(
            tag,
            min=hist.min,
            max=hist.max,
            num=hist.num,
            sum=hist.sum,
            sum_squares=hist.sum_squares,
            bucket_limits=np.asarray(hist.edges, dtype=np.float64)[1:].tolist(),
            bucket_counts=np.asarray(hist.counts).tolist(),
            global_step=step,
        )


def _is_number(value: Any) -> bool:
    """A Python or NumPy real number, or an array holding exactly one."""
    if isinstance(value, (numbers.Real, np.number, np.bool_)):
        return True
    return isinstance(value, np.ndarray) and value.size == 1 and np.issubdtype(value.dtype, np.number)


def flatten_hparams(config: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """The leaves of a nested config as ``{"trainer.seed": 0, ...}``: the one-level mapping of
    numbers, booleans and strings that the HParams dashboard shows. Lists (and empty
    mappings) become their JSON text; ``None`` leaves are left out (the dashboard has no null)."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_hparams(value, prefix=f"{name}."))
        elif value is None:
            continue
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def describe_artifact(path: str, type: str | None = None) -> str:
    """Markdown for TensorBoard's text dashboard: a text file's contents in a code block;
    for a directory, a binary file or a text file too large to copy, where it is."""
    kind = f" ({type})" if type else ""
    if os.path.isdir(path):
        files = sum(len(names) for _, _, names in os.walk(path))
        return f"directory `{path}`{kind}: {files} files"
    size = os.path.getsize(path)
    if size > MAX_TEXT_ARTIFACT_BYTES:
        return f"file `{path}`{kind}: {size:,} bytes, too large to show here"
    text = _read_text(path)
    if text is None:
        return f"file `{path}`{kind}: {size:,} bytes of binary data"
    language = os.path.splitext(path)[1].lstrip(".")
    return f"`{path}`{kind}\n\n{_code_block(text, language)}"


def _read_text(path: str) -> str | None:
    """The file's contents if it is UTF-8 text, else None."""
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _session_end(status: RunStatus):
    """The HParams dashboard's end-of-session record (its Status column) for a run that ended
    as ``status`` says. tensorboardX's ``hparams`` writes one that always says success."""
    end = SessionEndInfo(
        status=Status.Value("STATUS_SUCCESS" if status == "success" else "STATUS_FAILURE"),
        end_time_secs=time.time(),
    )
    content = HParamsPluginData(session_end_info=end, version=0).SerializeToString()
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="hparams", content=content))
    return Summary(value=[Summary.Value(tag="_hparams_/session_end_info", metadata=metadata)])


def _code_block(text: str, language: str = "") -> str:
    """``text`` as a Markdown code block, fenced with more backticks than it contains in a row."""
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text.rstrip(chr(10))}\n{fence}"
