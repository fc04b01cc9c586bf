"""Golden loss curves (:mod:`levanter_core.testing.golden`): every shipped nano config has one
(but those of :data:`WITHOUT_GOLDEN`, each with its reason), and the comparison fails, with a
step-by-step table of golden and found losses, on any step beyond tolerance. The golden runs
themselves are each family's ``test_nano_config_trains`` (``golden_losses`` on its test class:
one run per config, in the plugins' tests); this module trains nothing and takes a second.

To record or rewrite curves (after a change meant to move the numbers; review the diff)::

    LEVANTER_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -n 0 -k nano_config_trains plugins/models-llama

Each golden run then writes ``<plugin package>/tests/assets/losses/<config>.json`` and is
skipped, naming the file (``docs/adding-an-architecture.md``, section 8)."""

from __future__ import annotations

import glob
import json
import math
import os

import pytest

from levanter_core.testing import golden

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "plugins", "*", "*", "configs", "*_nano.yaml")))
OVERRIDES = ["--trainer.num_train_steps", "20", "--data.train_urls", "[{workdir}/corpus/train.jsonl]"]

WITHOUT_GOLDEN = {
    "whisper_nano.yaml": (
        "no nano run of it exists to share: a golden run of its own, on 40 sentences eSpeak NG speaks in "
        "the test (1.5 s), takes about 18 s of CPU with JAX's compilation cache warm and a minute cold, "
        "nearly all of it tracing and lowering the encoder-decoder and the greedy transcription of its "
        "evaluation (eval/wer): beyond the few seconds the test suite can spend on a golden check"
    ),
}
"""Shipped nano configs without a golden curve, and why."""


def curve_of(config_path: str) -> str:
    """Where the golden curve of a plugin's nano config is kept: ``tests/assets/losses`` of
    its package (the ``golden_losses`` of its family's test class)."""
    package = os.path.dirname(os.path.dirname(config_path))
    name = os.path.splitext(os.path.basename(config_path))[0]
    return os.path.join(package, "tests", "assets", "losses", name + ".json")


def test_every_shipped_nano_config_is_a_plugins_and_has_a_golden_curve_or_a_reason():
    shipped = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "config", "*_nano.yaml"))}
    assert shipped <= {os.path.basename(p) for p in CONFIGS}, "a nano config in config/ that no plugin ships"
    for config in CONFIGS:
        path = curve_of(config)
        if os.path.basename(config) in WITHOUT_GOLDEN:
            assert not os.path.exists(path), f"{path} exists: take {os.path.basename(config)} off WITHOUT_GOLDEN"
            continue
        assert os.path.exists(path), f"no golden loss curve {path}: record it with {golden.UPDATE_VARIABLE}=1"
        with open(path) as f:
            curve = json.load(f)
        assert curve["config"] == os.path.basename(config)
        assert curve["steps"] == len(curve["losses"]) == golden.GOLDEN_STEPS
        assert all(math.isfinite(loss) for loss in curve["losses"])
        assert curve["backend"] == "cpu" and curve["jax"] and curve["date"]


def write_curve(tmp_path, losses: list[float], overrides=OVERRIDES) -> str:
    path = str(tmp_path / "tiny_nano.json")
    with open(path, "w") as f:
        json.dump({**golden.golden_record("tiny_nano.yaml", dict(enumerate(losses, 1)), overrides)}, f)
    return path


LOSSES = [5.0 - 0.1 * i for i in range(20)]


def test_the_same_curve_passes_and_one_within_tolerance_too(tmp_path):
    path = write_curve(tmp_path, LOSSES)
    golden.check_golden_losses(path, "tiny_nano.yaml", dict(enumerate(LOSSES, 1)), OVERRIDES)
    near = {step: loss * (1 + 0.5 * golden.RTOL) for step, loss in enumerate(LOSSES, 1)}
    golden.check_golden_losses(path, "tiny_nano.yaml", near, OVERRIDES)


def test_one_step_beyond_tolerance_fails_with_the_table_of_both_curves(tmp_path):
    path = write_curve(tmp_path, LOSSES)
    found = dict(enumerate(LOSSES, 1))
    found[7] *= 1 + 2 * golden.RTOL
    with pytest.raises(pytest.fail.Exception) as failure:
        golden.check_golden_losses(path, "tiny_nano.yaml", found, OVERRIDES)
    message = str(failure.value)
    assert "left its golden curve at 1 of 20 steps" in message
    rows = [line for line in message.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == 20
    assert [row.split()[0] for row in rows if "beyond tolerance" in row] == ["7"]
    assert f"{golden.UPDATE_VARIABLE}=1" in message


def test_a_missing_step_or_a_run_with_other_overrides_fails(tmp_path):
    path = write_curve(tmp_path, LOSSES)
    short = dict(enumerate(LOSSES[:19], 1))
    with pytest.raises(pytest.fail.Exception, match="at 1 of 20 steps"):
        golden.check_golden_losses(path, "tiny_nano.yaml", short, OVERRIDES)
    with pytest.raises(pytest.fail.Exception, match="(?s)the curve of another run.*rel. diff"):
        golden.check_golden_losses(path, "tiny_nano.yaml", dict(enumerate(LOSSES, 1)), [*OVERRIDES, "--x", "1"])


def test_a_missing_curve_skips_saying_how_to_record_it_and_the_variable_records_it(tmp_path, monkeypatch):
    path = str(tmp_path / "assets" / "tiny_nano.json")
    losses = dict(enumerate(LOSSES, 1))
    monkeypatch.delenv(golden.UPDATE_VARIABLE, raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"no golden loss curve .*{golden.UPDATE_VARIABLE}=1"):
        golden.check_golden_losses(path, "tiny_nano.yaml", losses, OVERRIDES)
    monkeypatch.setenv(golden.UPDATE_VARIABLE, "1")
    with pytest.raises(pytest.skip.Exception, match="wrote the golden loss curve"):
        golden.check_golden_losses(path, "tiny_nano.yaml", losses, OVERRIDES)
    with open(path) as f:
        written = json.load(f)
    assert (written["config"], written["steps"], written["overrides"]) == ("tiny_nano.yaml", 20, OVERRIDES)
    assert written["losses"] == LOSSES
    monkeypatch.delenv(golden.UPDATE_VARIABLE)
    golden.check_golden_losses(path, "tiny_nano.yaml", losses, OVERRIDES)


def test_the_overrides_a_curve_records_do_not_name_the_temporary_directory(tmp_path):
    data = golden.golden_corpus(str(tmp_path / "corpus"))
    recorded = golden.recorded_overrides(str(tmp_path), data, ["--trainer.train_batch_size", "4"])
    assert str(tmp_path) not in " ".join(recorded)
    assert "[{workdir}/corpus/train.jsonl]" in recorded and recorded[-2:] == ["--trainer.train_batch_size", "4"]
