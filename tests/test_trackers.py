"""Several trackers at once: a list under ``trainer.tracker`` gets every call, in a real run."""

import pytest

from conftest import code_docs, run_config, write_jsonl
from levanter_core.config.train import load_train_config
from levanter_core.run import run_training
from levanter_core.tracker import CompositeTracker, Histogram, Tracker


def test_a_list_of_trackers_gets_every_call_of_a_run(tmp_path, recorded_calls):
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(40))], "cache_dir": str(tmp_path / "cache")}
    trackers = [{"type": "recording", "label": "first"}, {"type": "recording", "label": "second"}]
    config, _ = load_train_config(run_config(tmp_path, data, run_id="two", steps=3, tracker=trackers))
    run_training(config, progress=False)

    assert set(recorded_calls) == {"first", "second"} and recorded_calls["first"] == recorded_calls["second"]
    kinds = [call[0] for call in recorded_calls["first"]]
    assert kinds[0] == "hparams" and kinds[-2:] == ["summary", "finish"]
    assert kinds.count("artifact") == 3  # the run record: config.yaml, run.json, requirements.txt
    assert [call[1] for call in recorded_calls["first"] if call[0] == "log"] == [1, 2, 3]


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
