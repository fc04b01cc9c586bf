"""DPO through ``levanter train``: a tiny Hugging Face Llama learns a rule from preference pairs
(a number's parity: the chosen answer is right, the rejected one wrong), with LoRA adapters (its
reference: the base without them) and with full weights (its reference: a frozen copy of the
starting weights); held-out pairs of other numbers are ranked better at the end than at the
start. A bad ``objective:`` section or data of another format is refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from levanter_core.testing import write_jsonl

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")


def parity_pairs(numbers) -> list[dict]:
    """``Is N even?`` answered rightly (chosen) and wrongly (rejected)."""
    pairs = []
    for n in numbers:
        right, wrong = (" yes", " no") if n % 2 == 0 else (" no", " yes")
        pairs.append({"prompt": f"Is {n} even?", "chosen": right, "rejected": wrong})
    return pairs


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[str, str]:
    """Training pairs of 400 numbers and 64 held-out pairs of numbers the training never sees."""
    directory = tmp_path_factory.mktemp("parity")
    numbers = np.random.default_rng(0).permutation(np.arange(100, 1000))
    train = write_jsonl(directory / "train.jsonl", parity_pairs(numbers[:400]))
    held_out = write_jsonl(directory / "validation.jsonl", parity_pairs(numbers[400:464]))
    return train, held_out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """A random two-layer Hugging Face Llama with the byte tokenizer's ``tokenizer.json``."""
    from levanter_core.data.tokenizer import ByteTokenizer
    from levanter_core.hf.parity import random_hf_model
    from levanter_preference.tests.conftest import LLAMA

    directory = tmp_path_factory.mktemp("llama")
    random_hf_model(transformers.LlamaConfig(**LLAMA), seed=0).save_pretrained(str(directory))
    (directory / "tokenizer.json").write_text(ByteTokenizer().to_tokenizer_json())
    return str(directory)


def run_config(tmp_path, data, llama_dir, *, steps: int, **extra) -> str:
    train, held_out = data
    config = {
        "data": {"tokenizer": "byte", "train_urls": [train], "validation_urls": [held_out],
                 "cache_dir": str(tmp_path / "cache"), "shuffle": True},
        "objective": {"type": "dpo", "beta": 0.1},
        "initialize_from_hf": llama_dir,  # no model section: the Hugging Face model's architecture
        "max_train_length": 24,
        "trainer": {"id": "run", "train_batch_size": 16, "num_train_steps": steps, "steps_per_eval": steps,
                    "per_device_eval_parallelism": 32, "max_eval_batches": 2, "log_dir": str(tmp_path / "logs"),
                    "checkpointer": {"base_path": str(tmp_path / "ckpt"), "keep": []}},
        "optimizer": {"learning_rate": 1e-3, "weight_decay": 0.0, "warmup": 0.0},
        **extra,
    }  # fmt: skip
    path = tmp_path / "dpo.yaml"
    path.write_text(json.dumps(config))
    return str(path)


def levanter(*args: str) -> subprocess.CompletedProcess:
    """``levanter ARGS`` in a subprocess, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-c", "from levanter_core.cli import main; main()", *args],
        capture_output=True, text=True, timeout=900, env=os.environ.copy(),
    )  # fmt: skip


def evaluations(tmp_path) -> dict[int, dict]:
    """The metrics of each evaluation of the run, by step."""
    lines = (tmp_path / "logs" / "run" / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines) if "eval/dpo_accuracy" in m}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("weights", "extra"),
    [pytest.param("lora", {"lora": {"r": 8, "alpha": 16},
                           "optimizer": {"learning_rate": 1e-2, "weight_decay": 0.0, "warmup": 0.0}}, id="lora"),
     pytest.param("full", {}, id="full")],
)  # fmt: skip
def test_a_dpo_run_ranks_held_out_pairs_better(tmp_path, data, llama_dir, weights, extra):
    steps = 100
    result = levanter("train", run_config(tmp_path, data, llama_dir, steps=steps, **extra), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("LoRA: training" in result.stdout) == (weights == "lora")

    evaluated = evaluations(tmp_path)
    start, end = evaluated[0], evaluated[steps]
    # the policy starts as its reference: every reward is 0, so no pair is ranked right, the loss is log 2
    assert start["eval/dpo_accuracy"] == 0 and start["eval/loss"] == pytest.approx(np.log(2), abs=1e-4)
    # at the end (100 steps) both runs rank every held-out pair right (accuracy 1.0, margins of 2 to 3.4)
    assert end["eval/dpo_accuracy"] >= 0.9, end
    assert end["eval/dpo_margin"] > 0.5 and end["eval/loss"] < 0.4
    trained = [m for m in map(json.loads, (tmp_path / "logs" / "run" / "metrics.jsonl").read_text().splitlines())
               if "dpo/accuracy" in m]  # fmt: skip
    assert (
        trained
        and {"dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin", "dpo/logps_chosen"} <= trained[-1].keys()
    )
    # throughput counts both sequences of a pair, and model FLOP/s the reference's forward pass too
    from levanter_core.config.train import load_train_config

    model = load_train_config(run_config(tmp_path, data, llama_dir, steps=steps, **extra))[0].model
    timed = [m for m in trained if "throughput/model_gflops_per_second" in m][-1]
    per_token = timed["throughput/model_gflops_per_second"] * 1e9 / timed["throughput/tokens_per_second"]
    assert per_token == pytest.approx(model.flops_per_token(model_vocab(llama_dir)) * 4 / 3, rel=1e-9)


def model_vocab(llama_dir: str) -> int:
    return json.loads((Path(llama_dir) / "config.json").read_text())["vocab_size"]


def test_bad_objective_settings_name_the_field(tmp_path, data, llama_dir):
    from levanter_core.config.train import load_train_config
    from levanter_core.errors import ConfigError

    config = run_config(tmp_path, data, llama_dir, steps=2)
    for override, message in ((["--objective", '{"type": "dpo", "beta": 0}'], "beta"),
                              (["--objective", '{"type": "dpo", "label_smoothing": 0.5}'], "label_smoothing"),
                              (["--objective", '{"type": "dpo", "temperature": 1}'], "temperature")):  # fmt: skip
        with pytest.raises(ConfigError) as raised:
            load_train_config(config, override)
        assert "objective" in str(raised.value) and message in str(raised.value)

    loaded, _ = load_train_config(config, ["--objective", '{"type": "dpo", "beta": 0.25, "label_smoothing": 0.1}'])
    from levanter_preference.objective import DpoObjective

    objective = DpoObjective.from_config(loaded)
    assert (objective.beta, objective.label_smoothing) == (0.25, 0.1)
    assert loaded.data.configs[next(iter(loaded.data.configs))].format.type == "preference"  # the objective's default


def test_data_of_another_format_is_refused_by_name_when_the_config_loads(tmp_path, data, llama_dir):
    from levanter_core.config.train import load_train_config
    from levanter_core.errors import ConfigError

    # refused as the config loads, before a cache is built or a device touched
    with pytest.raises(ConfigError, match=r"data\.format: the dpo objective reads preference pairs .* 'text'"):
        load_train_config(run_config(tmp_path, data, llama_dir, steps=2), ["--data.format", '{"type": "text"}'])
    assert not (tmp_path / "cache").exists()
