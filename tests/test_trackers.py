"""Several trackers at once: a list under ``trainer.tracker`` gets every call, in a real run."""

import json

import pytest

import levanter_core.plugins as plugins
from levanter_core.config.train import load_train_config
from levanter_core.plugins import hookimpl
from levanter_core.tracker import CompositeTracker, Histogram, Tracker
from levanter_core.tracker.base import TrackerConfig
from levanter_core.trainer.run import run_training

CALLS: dict[str, list] = {}


class Recording(Tracker):
    def __init__(self, label: str):
        self.label = label
        CALLS[label] = []

    def log(self, metrics, *, step):
        CALLS[self.label].append(("log", step, sorted(metrics)))

    def log_summary(self, metrics):
        CALLS[self.label].append(("summary", sorted(metrics)))

    def log_hyperparameters(self, hparams):
        CALLS[self.label].append(("hparams", sorted(hparams)))

    def log_artifact(self, path, *, name=None, type=None):
        CALLS[self.label].append(("artifact", name, type))

    def finish(self):
        CALLS[self.label].append(("finish",))


class RecordingConfig(TrackerConfig):
    type: str = "recording"
    label: str = "a"

    def init(self, run):
        return Recording(self.label)


class Plugin:
    @hookimpl
    def register_trackers(self, register):
        register("recording", RecordingConfig)


@pytest.fixture
def recording():
    CALLS.clear()
    plugins.reset()
    plugins.register_plugin(Plugin(), name="recording")
    yield
    plugins.reset()


def test_a_list_of_trackers_gets_every_call_of_a_run(tmp_path, recording):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": f"z = {i}\n" * 20}) + "\n" for i in range(40)))
    (tmp_path / "run.yaml").write_text(
        f"""
data: {{train_urls: ["{tmp_path}/train.jsonl"], cache_dir: {tmp_path}/cache}}
model: {{type: gpt2, hidden_dim: 32, num_heads: 2, num_layers: 1, seq_len: 32}}
trainer:
  id: two
  train_batch_size: 4
  num_train_steps: 3
  log_dir: {tmp_path}/logs
  checkpointer: {{base_path: {tmp_path}/ckpt}}
  tracker: [{{type: recording, label: first}}, {{type: recording, label: second}}]
"""
    )
    config, _ = load_train_config(str(tmp_path / "run.yaml"))
    run_training(config, progress=False)

    assert set(CALLS) == {"first", "second"} and CALLS["first"] == CALLS["second"]
    kinds = [call[0] for call in CALLS["first"]]
    assert kinds[0] == "hparams" and kinds[-2:] == ["summary", "finish"]
    assert kinds.count("artifact") == 3  # the run record: config.yaml, run.json, requirements.txt
    assert [call[1] for call in CALLS["first"] if call[0] == "log"] == [1, 2, 3]


def test_the_composite_finishes_every_tracker_even_if_one_fails():
    finished = []

    class Failing(Tracker):
        def log(self, metrics, *, step):
            pass

        def finish(self):
            finished.append("failing")
            raise RuntimeError("disk full")

    class Fine(Tracker):
        def log(self, metrics, *, step):
            pass

        def finish(self):
            finished.append("fine")

    with pytest.raises(RuntimeError, match="disk full"):
        CompositeTracker([Failing(), Fine()]).finish()
    assert finished == ["failing", "fine"]


def test_a_histogram_summarizes_values_and_counts_non_finite_ones():
    h = Histogram.from_values([1.0, 2.0, 3.0, float("nan")], bins=4)
    assert h.num == 4 and int(h.counts.sum()) == 3 and (h.min, h.max) == (1.0, 3.0)
    assert h.sum == 6.0 and h.sum_squares == 14.0 and len(h.edges) == 5
