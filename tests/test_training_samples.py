"""``trainer.sample``: the model continues the prompts every interval and the trackers get the texts."""

import json

import pytest

from conftest import run_config, write_jsonl
from levanter_core.config.train import load_train_config
from levanter_core.errors import ConfigError
from levanter_core.run import run_training


@pytest.mark.slow
def test_a_run_logs_samples_every_interval(tmp_path):
    docs = [{"text": f"print({i})\n" * 8} for i in range(60)]
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", docs)], "cache_dir": str(tmp_path / "cache")}
    sample = {"prompts": ["print(", "def f"], "interval": 2, "max_new_tokens": 6}
    path = run_config(tmp_path, data, run_id="samples", steps=5, sample=sample)
    config, _ = load_train_config(path)
    run_training(config, progress=False)

    with open(tmp_path / "logs" / "samples" / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    with_samples = [r for r in logged if "samples/0" in r]
    assert [r["step"] for r in with_samples] == [2, 4, 5]
    for r in with_samples:
        assert r["samples/0"].startswith("print(") and r["samples/1"].startswith("def f")
        assert len(r["samples/0"]) > len("print(")  # something was generated (bytes: at most 6 characters)
        assert len(r["samples/0"]) <= len("print(") + 6


def test_sample_needs_prompts(tmp_path):
    path = run_config(tmp_path, {"train_urls": ["x.jsonl"]}, sample={"prompts": [], "interval": 2})
    with pytest.raises(ConfigError, match="trainer.sample.prompts"):
        load_train_config(path)
