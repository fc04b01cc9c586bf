"""``Tracker.finish`` is told how the run ended, so that a tracker can mark a failed run as
failed; a tracker written before it took that argument (``def finish(self)``) still works."""

import warnings

import pytest

import levanter_core.plugins as plugins
from conftest import code_docs, run_config, write_jsonl
from levanter_core.config.train import load_train_config
from levanter_core.plugins import hookimpl
from levanter_core.run import run_training
from levanter_core.tracker import CompositeTracker, RunStatus, Tracker, TrackerConfig, finish_tracker
from levanter_core.trainer.trainer import NonFiniteLossError

ENDINGS: list[tuple[str, object]] = []
"""(tracker kind, what its finish received) for every tracker finished, in order."""


class StatusTracker(Tracker):
    def log(self, metrics, *, step):
        pass

    def finish(self, status: RunStatus = "success"):
        ENDINGS.append(("new", status))


class OldTracker(Tracker):
    """A tracker as written against the API before ``finish`` took the status."""

    def log(self, metrics, *, step):
        pass

    def finish(self):
        ENDINGS.append(("old", None))


class StatusTrackerConfig(TrackerConfig):
    def init(self, run):
        return StatusTracker()


class OldTrackerConfig(TrackerConfig):
    def init(self, run):
        return OldTracker()


class EndingTrackers:
    @hookimpl
    def register_trackers(self, register):
        register("status", StatusTrackerConfig)
        register("old-style", OldTrackerConfig)


@pytest.fixture
def endings():
    plugins.reset()
    plugins.register_plugin(EndingTrackers(), name="ending-trackers")
    ENDINGS.clear()
    yield ENDINGS
    plugins.reset()


def test_finish_tracker_passes_the_status_to_new_trackers_and_none_to_old_ones(endings):
    finish_tracker(StatusTracker(), "failed")
    with pytest.warns(DeprecationWarning, match=r"OldTracker.finish\(\) takes no argument"):
        finish_tracker(OldTracker(), "failed")
    with pytest.warns(DeprecationWarning):
        CompositeTracker([StatusTracker(), OldTracker()]).finish("interrupted")
    assert endings == [("new", "failed"), ("old", None), ("new", "interrupted"), ("old", None)]


def test_a_status_passed_by_keyword_only_is_given_by_keyword(endings):
    class KeywordOnly(StatusTracker):
        def finish(self, *, status="success"):
            ENDINGS.append(("keyword", status))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it takes the status: no deprecation warning
        finish_tracker(KeywordOnly(), "failed")
    assert endings == [("keyword", "failed")]


def test_an_unknown_status_is_refused():
    with pytest.raises(ValueError, match="success, failed, interrupted"):
        finish_tracker(StatusTracker(), "crashed")


def _run(tmp_path, *overrides):
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(40))], "cache_dir": str(tmp_path / "cache")}
    trackers = [{"type": "status"}, {"type": "old-style"}, {"type": "json"}]
    path = run_config(tmp_path, data, run_id="ending", steps=3, steps_per_eval=100, tracker=trackers)
    config, _ = load_train_config(path, list(overrides))
    return run_training(config, progress=False)


@pytest.mark.slow
def test_a_run_that_succeeds_tells_its_trackers_so(tmp_path, endings):
    _run(tmp_path)
    assert endings == [("new", "success"), ("old", None)]


@pytest.mark.slow
def test_a_run_stopped_by_a_nan_loss_tells_its_trackers_it_failed(tmp_path, endings):
    with pytest.raises(NonFiniteLossError):
        _run(tmp_path, "--optimizer.learning_rate", "1e38", "--trainer.num_train_steps", "20")
    # The old-style tracker was still finished (it just cannot be told why).
    assert endings == [("new", "failed"), ("old", None)]
