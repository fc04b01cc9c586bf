"""Distillation through ``levanter train``, in process: a tiny GPT-2 teacher is trained first on
small generated code, then a smaller student twice with the same seed, data and steps, once
distilled from the teacher and once on the data alone; the distilled one ends with the lower
held-out loss. The teacher is not saved in the student's checkpoints, and the run resumes. A bad
``objective:`` section, and a teacher of another vocabulary, are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from haliax import Axis

from levanter_core.checkpoint import discover_latest, read_metadata
from levanter_core.config.train import load_train_config
from levanter_core.errors import ConfigError
from levanter_core.run import run_training
from levanter_core.testing import code_docs, logged, run_config, tiny_model, write_jsonl

STUDENT_STEPS = 30


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("code")
    return {
        "train_urls": [write_jsonl(directory / "train.jsonl", code_docs(400))],
        "validation_urls": [write_jsonl(directory / "validation.jsonl", code_docs(40, offset=5000))],
        "cache_dir": str(directory / "cache"),
    }


def train(tmp_path: Path, data: dict, run_id: str, *, steps: int, model: dict, overrides=(), **trainer):
    path = run_config(tmp_path, data, run_id=run_id, steps=steps, model=model, steps_per_eval=steps,
                      train_batch_size=8, max_eval_batches=4, **trainer)  # fmt: skip
    config, _ = load_train_config(path, list(overrides))
    return run_training(config, config_path=path, progress=False)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, data) -> str:
    """A two-layer GPT-2 of width 64 trained 150 steps: its checkpoint directory."""
    tmp_path = tmp_path_factory.mktemp("teacher")
    result = train(tmp_path, data, "teacher", steps=150, model=tiny_model(hidden_dim=64, num_layers=2, num_heads=4))
    assert result.checkpoint is not None
    return result.checkpoint


def test_a_distilled_student_beats_one_trained_on_the_data_alone(tmp_path, data, teacher):
    objective = json.dumps({"type": "distill", "teacher": teacher, "temperature": 1.0, "alpha": 1.0})
    distilled = train(tmp_path, data, "distilled", steps=STUDENT_STEPS, model=tiny_model(),
                      overrides=["--objective", objective])  # fmt: skip
    alone = train(tmp_path, data, "alone", steps=STUDENT_STEPS, model=tiny_model())
    print(f"held-out loss after {STUDENT_STEPS} steps: distilled {distilled.final_eval_loss:.4f}, "
          f"data alone {alone.final_eval_loss:.4f}")  # fmt: skip
    assert distilled.final_eval_loss < alone.final_eval_loss - 0.03

    kl, ce = logged(distilled.run_dir, "distill/kl"), logged(distilled.run_dir, "distill/ce")
    assert kl[STUDENT_STEPS] < kl[1] and ce[STUDENT_STEPS] < ce[1]
    # the checkpoint holds the student, its optimizer state, step and key; never the teacher
    saved = read_metadata(discover_latest(str(tmp_path / "ckpt" / "distilled")))
    names = [leaf["name"] for leaf in saved["leaves"]]
    assert any(n.startswith("model/") for n in names) and not any(n.startswith("reference") for n in names)

    # a resumed run loads the student and the teacher again and trains on
    resumed = train(tmp_path, data, "distilled", steps=STUDENT_STEPS + 2, model=tiny_model(),
                    overrides=["--objective", objective])  # fmt: skip
    assert resumed.start_step == STUDENT_STEPS and resumed.final_step == STUDENT_STEPS + 2
    assert STUDENT_STEPS + 2 in logged(distilled.run_dir, "distill/kl")


def test_bad_settings_are_refused_by_name(tmp_path, data, teacher):
    path = run_config(tmp_path, data, run_id="bad", model=tiny_model())
    for objective, field in (({"temperature": 0}, "temperature"), ({"alpha": 1.5}, "alpha"),
                             ({"alpha": -0.1}, "alpha"), ({"top_k": 0}, "top_k"), ({"beta": 1}, "beta"),
                             ({"teacher": None}, "teacher")):  # fmt: skip
        section = json.dumps({"type": "distill", "teacher": teacher, **objective})
        with pytest.raises(ConfigError) as raised:
            load_train_config(path, ["--objective", section])
        assert "objective" in str(raised.value) and field in str(raised.value), str(raised.value)

    from levanter_distill.objective import DistillObjective

    with pytest.raises(ConfigError, match=r"objective\.teacher: .* vocabulary of 257 tokens, the student 300"):
        DistillObjective(teacher=teacher).frozen_model(Axis("vocab", 300))
    with pytest.raises(
        ConfigError, match=r"objective\.teacher: .* reads at most 32 positions, but the run trains on 64"
    ):
        DistillObjective(teacher=teacher, seq_len=64).frozen_model(Axis("vocab", 257))
