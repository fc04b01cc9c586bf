"""The ``type: tensorboard`` tracker, read back as TensorBoard reads it: event files loaded with
TensorBoard's own EventAccumulator after a tracker wrote them, directly and from a short
training run."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

from levanter_core.config.train import load_train_config
from levanter_core.errors import ConfigError
from levanter_core.run import run_training
from levanter_core.tracker import Histogram, RunInfo
from levanter_tracker_tensorboard import TensorboardConfig

CONFIG = {
    "model": {"type": "gpt2", "hidden_dim": 32, "num_layers": 1},
    "trainer": {
        "num_train_steps": 100,
        "mp": "p=f32",
        "tracker": [{"type": "json"}, {"type": "tensorboard"}],
    },
    "optimizer": {"learning_rate": 0.003, "weight_decay": None},
    "data": {"train_urls": ["a.jsonl", "b.jsonl"]},
}


def read_events(event_dir) -> EventAccumulator:
    """Everything TensorBoard would show for the run in ``event_dir`` (0: keep every event)."""
    events = EventAccumulator(str(event_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in events.Scalars(tag)}


def texts(events: EventAccumulator, tag: str) -> dict[int, str]:
    """Text logged under ``tag`` (tensorboardX stores it as ``{tag}/text_summary``) by step."""
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")}


def code_in(markdown: str) -> str:
    """The contents of the (only) fenced code block in ``markdown``."""
    return markdown.split("```", 2)[1].split("\n", 1)[1]


def new_tracker(tmp_path, *, resume_step=None, **fields):
    run = RunInfo(
        run_id="run1",
        run_dir=str(tmp_path / "logs" / "run1"),
        config={},
        resume_step=resume_step,
    )
    config = TensorboardConfig(type="tensorboard", **fields)
    return config.init(run), config.event_dir(run)


def test_scalars_histograms_and_text_are_read_back_at_their_steps(tmp_path):
    tracker, event_dir = new_tracker(tmp_path)
    weights = np.random.default_rng(0).normal(size=1000)
    tracker.log({"train/loss": 3.5, "optim/learning_rate": np.float32(0.01)}, step=1)
    tracker.log(
        {"train/loss": 3.25, "params/w": Histogram.from_values(weights, bins=16)},
        step=2,
    )
    tracker.log({"train/loss": 3.0, "samples/text": "the cat sat", "odd": object()}, step=3)
    tracker.finish()

    events = read_events(event_dir)
    assert scalars(events, "train/loss") == {1: 3.5, 2: 3.25, 3: 3.0}
    assert scalars(events, "optim/learning_rate") == {1: pytest.approx(0.01)}
    [hist] = events.Histograms("params/w")
    assert hist.step == 2
    assert hist.histogram_value.num == 1000
    assert sum(hist.histogram_value.bucket) == 1000
    assert hist.histogram_value.min == pytest.approx(weights.min())
    assert hist.histogram_value.max == pytest.approx(weights.max())
    assert hist.histogram_value.bucket_limit[-1] == pytest.approx(weights.max())
    assert texts(events, "samples/text") == {3: "the cat sat"}
    assert "odd" not in events.Tags()["scalars"]


def test_the_config_is_text_and_hyperparameters(tmp_path):
    tracker, event_dir = new_tracker(tmp_path)
    tracker.log_hyperparameters(CONFIG)
    tracker.finish()

    events = read_events(event_dir)
    assert yaml.safe_load(code_in(texts(events, "config")[0])) == CONFIG
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["trainer.num_train_steps"].number_value == 100
    assert hparams["model.type"].string_value == "gpt2"
    assert hparams["trainer.mp"].string_value == "p=f32"
    assert json.loads(hparams["data.train_urls"].string_value) == ["a.jsonl", "b.jsonl"]
    assert "optimizer.weight_decay" not in hparams  # None has no place in the dashboard


@pytest.mark.parametrize("status, shown", [("success", "STATUS_SUCCESS"), ("failed", "STATUS_FAILURE")])
def test_how_the_run_ended_is_the_status_of_its_hparams_session(tmp_path, status, shown):
    from tensorboard.plugins.hparams.api_pb2 import Status

    tracker, event_dir = new_tracker(tmp_path)
    tracker.log_hyperparameters(CONFIG)
    tracker.log({"train/loss": 3.5}, step=1)
    tracker.finish(status)

    content = read_events(event_dir).PluginTagToContent("hparams")["_hparams_/session_end_info"]
    assert Status.Name(HParamsPluginData.FromString(content).session_end_info.status) == shown


def test_summary_and_artifacts_follow_the_last_step(tmp_path):
    text_file = tmp_path / "config.yaml"
    text_file.write_text("seed: 0\n")
    binary_file = tmp_path / "weights.bin"
    binary_file.write_bytes(b"\0\1\2\3")
    tracker, event_dir = new_tracker(tmp_path)
    tracker.log({"train/loss": 2.0}, step=7)
    tracker.log_summary({"last_loss": 2.0, "run_id": "run1"})
    tracker.log_artifact(str(text_file), name="config.yaml", type="run_record")
    tracker.log_artifact(str(binary_file))
    tracker.finish()

    events = read_events(event_dir)
    assert scalars(events, "summary/last_loss") == {7: 2.0}
    assert texts(events, "summary/run_id") == {7: "run1"}
    assert code_in(texts(events, "artifacts/config.yaml")[7]) == "seed: 0\n"
    assert "4 bytes of binary data" in texts(events, "artifacts/weights.bin")[7]


def test_a_resumed_run_drops_the_steps_the_interrupted_attempt_logged_after_its_checkpoint(
    tmp_path,
):
    first, event_dir = new_tracker(tmp_path)
    for step in range(1, 7):
        first.log({"train/loss": 10.0 + step}, step=step)
    first.finish()  # "killed" after step 6; the last checkpoint is step 3

    resumed, same_dir = new_tracker(tmp_path, resume_step=3)
    for step in range(4, 9):
        resumed.log({"train/loss": 20.0 + step}, step=step)
    resumed.finish()

    assert same_dir == event_dir
    logged = read_events(event_dir).Scalars("train/loss")
    assert [(e.step, e.value) for e in logged] == [(1, 11.0), (2, 12.0), (3, 13.0)] + [
        (s, 20.0 + s) for s in range(4, 9)
    ]


def test_logdir_defaults_to_the_run_directory_and_a_relative_one_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = RunInfo(run_id="run1", run_dir=str(tmp_path / "logs" / "run1"), config={})
    assert TensorboardConfig(type="tensorboard").event_dir(run) == str(tmp_path / "logs" / "run1" / "tensorboard")
    assert TensorboardConfig(type="tensorboard", logdir="tb").event_dir(run) == str(tmp_path / "tb" / "run1")


def test_a_bad_field_names_its_dotted_path(tmp_path):
    path = tmp_path / "bad.yaml"
    trackers = [{"type": "json"}, {"type": "tensorboard", "flush_secs": 0}]
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"type": "gpt2"},
                "data": {"train_urls": ["a.jsonl"]},
                "trainer": {"tracker": trackers},
            }
        )
    )
    with pytest.raises(ConfigError, match=r"trainer\.tracker\.1\.flush_secs.*greater than 0"):
        load_train_config(str(path))


def test_a_training_run_writes_the_losses_of_metrics_jsonl(tmp_path):
    data_file = tmp_path / "train.jsonl"
    data_file.write_text(
        "".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 3}) + "\n" for i in range(100))
    )
    config = {
        "data": {"train_urls": [str(data_file)], "tokenizer": "byte", "cache_dir": str(tmp_path / "cache")},
        "model": {
            "type": "gpt2",
            "hidden_dim": 32,
            "num_heads": 2,
            "num_layers": 1,
            "seq_len": 32,
        },
        "trainer": {
            "id": "tb",
            "train_batch_size": 4,
            "num_train_steps": 5,
            "log_dir": str(tmp_path / "logs"),
            "checkpointer": {"base_path": str(tmp_path / "ckpt"), "keep": []},
            "tracker": [{"type": "json"}, {"type": "tensorboard"}],
        },
        "optimizer": {"learning_rate": 1e-2, "warmup": 0},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded, _ = load_train_config(str(path))

    run_training(loaded, progress=False)

    run_dir = tmp_path / "logs" / "tb"
    with open(run_dir / "metrics.jsonl") as f:
        jsonl = {r["step"]: r["train/loss"] for r in map(json.loads, f) if "train/loss" in r}
    events = read_events(run_dir / "tensorboard")
    assert sorted(jsonl) == [1, 2, 3, 4, 5]
    assert scalars(events, "train/loss") == pytest.approx(jsonl, rel=1e-6)
    assert yaml.safe_load(code_in(texts(events, "config")[0]))["trainer"]["id"] == "tb"
    assert "artifacts/requirements.txt/text_summary" in events.Tags()["tensors"]
    assert scalars(events, "summary/last_loss") == {5: pytest.approx(jsonl[5])}


def test_discovered_through_its_entry_point():
    levanter = os.path.join(os.path.dirname(sys.executable), "levanter")
    out = subprocess.run(
        [levanter, "plugins", "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    listed = {p["distribution"]: p for p in json.loads(out.stdout)["plugins"]}
    ours = listed["levanter-tracker-tensorboard"]
    assert ours["error"] is None
    assert ours["types"] == {"tracker": ["tensorboard"]}
