import json
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
from levanter_core.testing import MODEL, code_docs, run_config, write_jsonl  # noqa: F401
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


def run_cli(*args: str, cwd: str | None = None, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
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


# -- a tiny training run (its config: levanter_core.testing.run_config) -----------------------


def metrics(tmp_path, run_id="pipe"):
    """The lines of a run's ``metrics.jsonl``."""
    with open(tmp_path / "logs" / run_id / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


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
