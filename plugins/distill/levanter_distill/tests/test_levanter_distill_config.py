"""Levanter's ``distill_lm`` config loads as a run of the ``distill`` objective; what it has that
is not available here is refused by name."""

from __future__ import annotations

import pytest
import yaml

from levanter_core.config.train import load_train_config
from levanter_core.errors import ConfigError
from levanter_core.testing import tiny_model


def distill_lm(tmp_path, **fields) -> str:
    config = {
        "data": {"tokenizer": "byte", "train_urls": [str(tmp_path / "train.jsonl")]},
        "trainer": {"train_batch_size": 4, "num_train_steps": 10},
        "optimizer": {"learning_rate": 1e-3},
        "student_model": tiny_model(),
        "teacher_model": {"type": "llama", "hidden_dim": 64},
        "teacher_initialize_from_hf": "org/teacher",
        "objective": "forward_kl",
        "train_seq_len": 16,
        **fields,
    }
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_distill_lm_config_is_a_distill_run(tmp_path):
    config, _ = load_train_config(distill_lm(tmp_path, taid={"start": 0.4}))
    assert config.model.type == "gpt2" and config.model.hidden_dim == 32 and config.train_seq_len == 16
    assert config.objective is not None and config.objective["type"] == "distill"
    options = config.objective_options
    assert (options.teacher, options.temperature, options.alpha, options.top_k) == ("org/teacher", 1.0, 1.0, None)


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"objective": "projected_hidden"}, "objective"), ({"objective": "taid"}, "taid"),
     ({"teacher_initialization": {"type": "truncate"}}, "teacher_initialization"),
     ({"teacher_use_hf_model_config": False}, "teacher_use_hf_model_config"),
     ({"student_anchor_indices": [0, 1]}, "student_anchor_indices")],
)  # fmt: skip
def test_what_is_not_available_is_refused_by_name(tmp_path, fields, named):
    with pytest.raises(ConfigError) as raised:
        load_train_config(distill_lm(tmp_path, **fields))
    message = str(raised.value)
    assert "distill_lm" in message and named in message and "distill.yaml" in message, message
