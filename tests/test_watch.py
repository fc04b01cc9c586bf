"""``trainer.watch``: norms and histograms of parameters, gradients and updates every N steps."""

import numpy as np
import pytest

from conftest import MODEL, code_docs, metrics, run_config, write_jsonl
from levanter_core.config.train import load_train_config
from levanter_core.run import run_training
from levanter_core.tracker import Histogram


def test_watch_logs_norms_every_interval_and_histograms_to_trackers(tmp_path, recorded_calls):
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(50))], "cache_dir": str(tmp_path / "cache")}
    watch = {"interval": 2, "watch_targets": ["params", "grads", "updates"], "include_histograms": True}
    path = run_config(
        tmp_path,
        data,
        run_id="watched",
        steps=4,
        model={**MODEL, "num_layers": 2},
        tracker=[{"type": "json"}, {"type": "recording"}],
        watch=watch,
    )
    config, _ = load_train_config(path)
    run_training(config, progress=False)

    received = [(call[1], call[2]) for call in recorded_calls["recording"] if call[0] == "log"]
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
    logged = {m["step"]: m for m in metrics(tmp_path, "watched") if "train/loss" in m}
    assert "watch/grads/norm" in logged[2] and not any("/hist/" in k for k in logged[2])
