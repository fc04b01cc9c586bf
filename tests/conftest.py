import os
import subprocess
import sys

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import pytest

import levanter_core.plugins as plugins
from levanter_core.plugins import hookimpl

# The tests import the tiny-run helpers from here.
from levanter_core.testing import MODEL, code_docs, read_metrics, run_config, write_jsonl  # noqa: F401
from levanter_core.tracker import Tracker, TrackerConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- a model for optimizer tests in the trainer -------------------------------------------------


class Centre(eqx.Module):
    """A model whose loss is the squared distance of its weights from the batch's mean token."""

    w: hax.NamedArray


def distance_loss(model, batch, *, key):
    """:class:`Centre`'s loss, as a trainer's loss function."""
    target = hax.mean(batch.tokens.astype(jnp.float32)).array
    return hax.mean((model.w - target) ** 2).array, {}


@pytest.fixture
def fresh_plugins():
    """A plugin manager without entry-point plugins; restored to the normal one afterwards."""
    manager = plugins.reset(autoload=False)
    yield manager
    plugins.reset()


# -- an S3-compatible server on 127.0.0.1 ---------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server, one per test worker (levanter_core.testing.LocalS3Server)."""
    from levanter_core.testing import LocalS3Server

    with LocalS3Server() as server:
        yield server


@pytest.fixture
def bucket(s3_server, monkeypatch) -> str:
    """A new, empty bucket (``s3://NAME``), with this process's environment (and so that of the
    processes a test starts) pointing S3 clients at the server."""
    import uuid

    for name, value in s3_server.environment.items():
        monkeypatch.setenv(name, value)
    return s3_server.create_bucket(f"test-{uuid.uuid4().hex[:12]}")


def bucket_objects(url: str) -> dict[str, bytes]:
    """Every object under ``url``, by its path relative to it."""
    from levanter_core import fileio

    fs, root = fileio.filesystem(url)
    fs.invalidate_cache()
    found = {}
    for path in fs.find(root):
        try:
            found[path[len(root) + 1 :]] = fs.cat_file(path)
        except FileNotFoundError:  # replaced or removed between the listing and the read: look again
            continue
    return found


def run_cli(
    *args: str, cwd: str | None = None, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run ``levanter ARGS`` in a subprocess, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", "from levanter_core.cli import main; main()", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


CLI_IN_PROCESS = r"""
import contextlib, io
from levanter_core.cli import main

def cli(*args):
    # ``levanter ARGS`` through the CLI's entry point in this process: its exit code (None if it
    # returned without exiting) and what it printed.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(list(args))
        except SystemExit as e:
            return e.code, out.getvalue()
    return None, out.getvalue()
"""
"""The start of a script for ``python -c`` that runs several ``levanter`` commands in one process
(one start of the framework instead of one each): it defines ``cli(*args) -> (code, stdout)``."""


# -- a tiny training run (its config: levanter_core.testing.run_config) -----------------------


def metrics(tmp_path, run_id="pipe"):
    """The lines of a run's ``metrics.jsonl``."""
    return read_metrics(tmp_path / "logs" / run_id)


# -- a tracker that keeps every call ----------------------------------------------------------


class RecordingTracker(Tracker):
    """Keeps every call it gets, in order, in ``RecordingTracker.calls[label]``."""

    calls: dict[str, list] = {}

    def __init__(self, label: str):
        self._calls = RecordingTracker.calls.setdefault(label, [])

    def log(self, metrics, *, step):
        self._calls.append(("log", step, dict(metrics)))

    def log_summary(self, metrics):
        self._calls.append(("summary", dict(metrics)))

    def log_hyperparameters(self, hparams):
        self._calls.append(("hparams", hparams))

    def log_artifact(self, path, *, name=None, type=None):
        with open(path) as f:
            self._calls.append(("artifact", name, type, f.read()))

    def finish(self, status="success"):
        self._calls.append(("finish", status))


class RecordingTrackerConfig(TrackerConfig):
    """``type: recording``: a :class:`RecordingTracker` filing its calls under ``label``."""

    label: str = "recording"

    def init(self, run):
        return RecordingTracker(self.label)


class RecordingTrackerPlugin:
    @hookimpl
    def register_trackers(self, register):
        register("recording", RecordingTrackerConfig)


@pytest.fixture
def recorded_calls():
    """``type: recording`` trackers are available; yields their calls by label."""
    plugins.reset()
    plugins.register_plugin(RecordingTrackerPlugin(), name="recording-tracker")
    RecordingTracker.calls = {}
    yield RecordingTracker.calls
    plugins.reset()
