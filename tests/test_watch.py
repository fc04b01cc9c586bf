"""``trainer.watch``: norms and histograms of parameters, gradients and updates every N steps."""

import json

import numpy as np
import pytest

from levanter_core.config.train import load_train_config
from levanter_core.tracker import Histogram
from levanter_core.trainer.run import run_training


def test_watch_logs_norms_every_interval_and_histograms_to_trackers(tmp_path):
    import levanter_core.plugins as plugins
    from levanter_core.plugins import hookimpl
    from levanter_core.tracker.base import Tracker, TrackerConfig

    received: list[tuple[int, dict]] = []

    class Recording(Tracker):
        def log(self, metrics, *, step):
            received.append((step, dict(metrics)))

    class RecordingConfig(TrackerConfig):
        type: str = "recording"

        def init(self, run):
            return Recording()

    class Plugin:
        @hookimpl
        def register_trackers(self, register):
            register("recording", RecordingConfig)

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": f"y = {i}\n" * 20}) + "\n" for i in range(50)))
    (tmp_path / "run.yaml").write_text(
        f"""
data: {{train_urls: ["{tmp_path}/train.jsonl"], cache_dir: {tmp_path}/cache}}
model: {{type: gpt2, hidden_dim: 32, num_heads: 2, num_layers: 2, seq_len: 32}}
trainer:
  id: watched
  train_batch_size: 4
  num_train_steps: 4
  log_dir: {tmp_path}/logs
  checkpointer: {{base_path: {tmp_path}/ckpt}}
  tracker: [{{type: json}}, {{type: recording}}]
  watch: {{interval: 2, watch_targets: [params, grads, updates], include_histograms: true}}
"""
    )
    plugins.reset()
    plugins.register_plugin(Plugin(), name="recording")
    try:
        config, _ = load_train_config(str(tmp_path / "run.yaml"))
        run_training(config, progress=False)
    finally:
        plugins.reset()

    by_step = {step: m for step, m in received if "train/loss" in m}
    assert sorted(by_step) == [1, 2, 3, 4]
    for step in (1, 3):
        assert not any(name.startswith("watch/") for name in by_step[step])
    for step in (2, 4):
        m = by_step[step]
        assert m["watch/grads/norm"] > 0 and m["watch/params/norm"] > 0 and m["watch/updates/norm"] > 0
        # The stacked blocks are split per layer; the global norm is the norm of the parts.
        per_layer = [k for k in m if k.startswith("watch/params/norm/") and k.endswith("/layer_1")]
        assert per_layer
        parts = [v for k, v in m.items() if k.startswith("watch/params/norm/")]
        assert np.sqrt(sum(v * v for v in parts)) == pytest.approx(m["watch/params/norm"], rel=1e-4)
        hists = [v for k, v in m.items() if k.startswith("watch/params/hist/")]
        assert hists and all(isinstance(h, Histogram) for h in hists)
        assert all(int(h.counts.sum()) == h.num and h.min <= h.max for h in hists)
    # The json tracker keeps the norms and leaves the histograms out.
    lines = [json.loads(line) for line in open(tmp_path / "logs" / "watched" / "metrics.jsonl")]
    logged = {m["step"]: m for m in lines if "train/loss" in m}
    assert "watch/grads/norm" in logged[2] and not any("/hist/" in k for k in logged[2])
