"""The csv tracker, called as a run calls it, checked by reading back the file a user opens."""

import csv
import math

import numpy as np
import pytest
from levanter_tracker_csv import plugin
from levanter_tracker_csv.tracker import CsvTrackerConfig
from pydantic import ValidationError

import levanter_core.plugins as plugins
from levanter_core.tracker import Histogram, RunInfo


def start(tmp_path, resume_step=None, **fields):
    run = RunInfo(run_id="csv-test", run_dir=str(tmp_path), config={}, resume_step=resume_step)
    return CsvTrackerConfig(type="csv", **fields).init(run)


def table(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_one_row_per_step_with_numbers_only(tmp_path):
    tracker = start(tmp_path)
    for step in (1, 2):
        tracker.log(
            {
                "train/loss": 3.0 / step,
                "optim/learning_rate": np.float32(0.5),
                "data/tokens": np.int64(128 * step),
                "sample/text": "def f(x):",
                "watch/params": Histogram.from_values(np.arange(10.0)),
            },
            step=step,
        )
    tracker.finish()
    assert table(tmp_path / "metrics.csv") == [
        ["step", "train/loss", "optim/learning_rate", "data/tokens"],
        ["1", "3.0", "0.5", "128"],
        ["2", "1.5", "0.5", "256"],
    ]


def test_floats_read_back_exactly_and_nan_stays_visible(tmp_path):
    tracker = start(tmp_path)
    tracker.log({"train/loss": 1 / 3}, step=1)
    tracker.log({"train/loss": float("nan")}, step=2)
    tracker.finish()
    rows = table(tmp_path / "metrics.csv")
    assert float(rows[1][1]) == 1 / 3
    assert math.isnan(float(rows[2][1]))


def test_a_name_appearing_later_extends_the_header(tmp_path):
    tracker = start(tmp_path)
    tracker.log({"train/loss": 2.0}, step=1)
    tracker.log({"train/loss": 1.5, "eval/loss": 1.8}, step=2)
    tracker.log({"train/loss": 1.0}, step=3)
    tracker.finish()
    assert table(tmp_path / "metrics.csv") == [
        ["step", "train/loss", "eval/loss"],
        ["1", "2.0", ""],
        ["2", "1.5", "1.8"],
        ["3", "1.0", ""],
    ]


def test_two_logs_at_one_step_fill_one_row(tmp_path):
    tracker = start(tmp_path)
    tracker.log({"train/loss": 2.0}, step=1)
    tracker.log({"train/loss": 1.5}, step=2)
    tracker.log({"watch/grad_norm": 0.25}, step=2)  # a new column, same step
    tracker.log({"viz/mean_logprob": -3.0}, step=2)  # another one
    tracker.log({"train/loss": 1.0}, step=3)
    tracker.log({"throughput/tokens_per_second": 99.0}, step=3)  # a known column, same step
    tracker.finish()
    assert table(tmp_path / "metrics.csv") == [
        ["step", "train/loss", "watch/grad_norm", "viz/mean_logprob", "throughput/tokens_per_second"],
        ["1", "2.0", "", "", ""],
        ["2", "1.5", "0.25", "-3.0", ""],
        ["3", "1.0", "", "", "99.0"],
    ]


def test_a_step_with_no_numbers_writes_no_row(tmp_path):
    tracker = start(tmp_path)
    tracker.log({"train/loss": 2.0}, step=1)
    tracker.log({"sample/text": "hello"}, step=2)
    tracker.finish()
    assert table(tmp_path / "metrics.csv") == [["step", "train/loss"], ["1", "2.0"]]


def test_resume_drops_rows_after_the_checkpoint_step(tmp_path):
    first = start(tmp_path)
    for step in range(1, 6):
        first.log({"train/loss": float(step)}, step=step)
    first.log({"eval/loss": 9.0}, step=5)
    # killed here, without finish(); the checkpoint is at step 3
    resumed = start(tmp_path, resume_step=3)
    resumed.log({"train/loss": 40.0}, step=4)
    resumed.finish()
    assert table(tmp_path / "metrics.csv") == [
        ["step", "train/loss", "eval/loss"],
        ["1", "1.0", ""],
        ["2", "2.0", ""],
        ["3", "3.0", ""],
        ["4", "40.0", ""],
    ]


def test_resume_ignores_a_line_cut_short_by_a_kill(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,train/loss\n1,1.0\n2,2.0\n3,3.")
    tracker = start(tmp_path, resume_step=3)
    tracker.log({"train/loss": 3.5}, step=3)
    tracker.finish()
    assert table(tmp_path / "metrics.csv") == [["step", "train/loss"], ["1", "1.0"], ["2", "2.0"], ["3", "3.5"]]


def test_a_fresh_start_replaces_an_earlier_attempts_table(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,train/loss,old/metric\n1,1.0,7\n2,2.0,7\n")
    tracker = start(tmp_path)
    tracker.log({"train/loss": 5.0}, step=1)
    tracker.finish()
    assert table(tmp_path / "metrics.csv") == [["step", "train/loss"], ["1", "5.0"]]


def test_filename_is_relative_to_the_run_directory_or_absolute(tmp_path):
    start(tmp_path, filename="tables/loss.csv").finish()
    assert table(tmp_path / "tables" / "loss.csv") == [["step"]]
    elsewhere = tmp_path / "elsewhere.csv"
    start(tmp_path / "run", filename=str(elsewhere)).finish()
    assert elsewhere.exists()


def test_an_empty_filename_is_rejected(tmp_path):
    with pytest.raises(ValidationError, match="filename"):
        CsvTrackerConfig(type="csv", filename="")


def test_the_plugin_registers_type_csv():
    plugins.reset(autoload=False)
    try:
        plugins.register_plugin(plugin, name="csv")
        entry = plugins.registry("tracker").get("csv")
        assert entry.config_cls is CsvTrackerConfig
        assert entry.plugin == "csv"
    finally:
        plugins.reset()
