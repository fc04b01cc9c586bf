"""``trainer.viz``: a heatmap of per-token log-probabilities every N steps, in the run
directory and sent to the trackers."""

import html
import math
import re

import numpy as np

from conftest import run_config, write_jsonl
from levanter_core.config.train import load_train_config
from levanter_core.run import run_training
from levanter_core.trainer.viz import heatmap_html


def test_the_heatmap_shades_unlikely_tokens_and_escapes_text():
    page = heatmap_html("t", [(["<a>", "b", "\n"], np.array([math.nan, -0.01, -12.0]))])
    assert "&lt;a&gt;" in page and "<a>" not in page.split("<body>")[1]
    assert "rgba(220, 30, 30, 0.00)" in page and "rgba(220, 30, 30, 1.00)" in page
    assert "log p = -12.00" in page


def test_a_run_draws_heatmaps_every_interval_and_sends_them_to_the_trackers(tmp_path, monkeypatch):
    from levanter_core.tracker.json_tracker import JsonTracker

    sent = []
    original = JsonTracker.log_artifact

    def log_artifact(self, path, *, name=None, type=None):
        if type == "viz":
            sent.append((name, type))
        return original(self, path, name=name, type=type)

    monkeypatch.setattr(JsonTracker, "log_artifact", log_artifact)
    docs = [{"text": f"print({i})\n" * 8} for i in range(60)]
    data = {
        "train_urls": [write_jsonl(tmp_path / "train.jsonl", docs)],
        "validation_urls": [write_jsonl(tmp_path / "valid.jsonl", docs)],
        "cache_dir": str(tmp_path / "cache"),
    }
    path = run_config(tmp_path, data, run_id="viz", steps=5, steps_per_eval=5, viz={"interval": 2, "num_sequences": 3})
    config, _ = load_train_config(path)
    run_training(config, progress=False)

    viz_dir = tmp_path / "logs" / "viz" / "viz"
    assert sorted(p.name for p in viz_dir.iterdir()) == ["step-2.html", "step-4.html", "step-5.html"]
    page = (viz_dir / "step-4.html").read_text()
    assert page.count('class="seq"') == 3
    scores = [float(v) for v in re.findall(r"log p = (-?[\d.]+)", page)]
    assert len(scores) == 3 * 31 and all(v <= 0 for v in scores)
    body = page.split("<body>")[1]
    assert "print(" in html.unescape(re.sub(r"<[^>]+>", "", body))  # the tokens, in order
    assert [(name, kind) for name, kind in sent] == [(f"viz/step-{n}.html", "viz") for n in (2, 4, 5)]
