"""A config written as Levanter's current ``train_dpo`` writes one (its ``dpo_tiny_gpt2.yaml``'s
shape: components with the ``preference_chat`` format, ``reference``, ``adapter``, ``beta``,
``train_seq_len`` and the default ``validation_split_fraction``) trains as a DPO run here."""

from __future__ import annotations

import json
import math

import pytest

from levanter_core.config.train import load_train_config
from levanter_core.run import run_training
from levanter_core.testing import write_jsonl
from levanter_preference.tests.test_training import data, llama_dir  # noqa: F401  (fixtures)

pytest.importorskip("transformers")
pytest.importorskip("torch")

TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% endif %}{% endfor %}"
)


def test_a_levanter_train_dpo_config_trains_and_validates_on_its_last_tenth(tmp_path, data, llama_dir):  # noqa: F811
    train, _ = data
    pairs = [
        {
            "chosen": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["chosen"]}],
            "rejected": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["rejected"]}],
        }
        for p in map(json.loads, open(train))
    ][:200]
    config = {
        "data": {
            "tokenizer": "byte",
            "cache_dir": str(tmp_path / "cache"),
            "components": {
                "default": {
                    "source": {"type": "url", "train_urls": [write_jsonl(tmp_path / "pairs.jsonl", pairs)]},
                    "format": {"type": "preference_chat", "chat_template": TEMPLATE, "pack": False},
                }
            },
        },
        "train_seq_len": 32,
        "trainer": {
            "id": "run", "train_batch_size": 16, "num_train_steps": 60, "steps_per_eval": 60,
            "log_dir": str(tmp_path / "logs"), "checkpointer": {"base_path": str(tmp_path / "ckpt"), "keep": []},
        },
        "optimizer": {"learning_rate": 1e-3, "weight_decay": 0.0, "warmup": 0.0},
        "adapter": {"type": "none"},
        "reference": {"type": "separate", "model_path": llama_dir, "is_hf": True},
        "beta": 0.1,
        "initialize_from_hf": llama_dir,
        "use_hf_model_config": True,
    }  # fmt: skip
    path = tmp_path / "train_dpo.yaml"
    path.write_text(json.dumps(config))
    loaded, _ = load_train_config(str(path))
    assert loaded.objective == {"type": "dpo", "beta": 0.1, "label_smoothing": 0.0}
    assert loaded.data.held_out() == {"default": 0.1} and loaded.train_length == 32
    run_training(loaded, config_path=str(path), progress=False)
    lines = (tmp_path / "logs" / "run" / "metrics.jsonl").read_text().splitlines()
    evaluated = {m["step"]: m for m in map(json.loads, lines) if "eval/dpo_accuracy" in m}
    # the held-out tenth (20 of the 200 pairs): at the start the policy is its reference (a loss
    # of log 2, no margin); after 60 steps it prefers the chosen answers of pairs it never saw
    # (here: a loss of 0.62 and a mean margin of 0.53)
    assert sorted(evaluated) == [0, 60]
    start, end = evaluated[0], evaluated[60]
    assert start["eval/loss"] == pytest.approx(math.log(2), abs=1e-4) and start["eval/dpo_margin"] == 0
    assert end["eval/loss"] < math.log(2) - 0.04 and end["eval/dpo_margin"] > 0.25, end
