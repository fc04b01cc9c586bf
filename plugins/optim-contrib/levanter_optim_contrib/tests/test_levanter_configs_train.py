"""Levanter's own Sophia and Muon configs train, their ``optimizer:`` sections unchanged: only
the data (a slice of the standard library, tokenized once for all of them), the model's size,
the run's length, the warmup (2,000 steps in some) and the tracker are overridden to fit a test.
(Some log to W&B, in ``trainer.wandb``, which wins over ``trainer.tracker``: it is dropped, so
that the runs log to JSON and start no W&B service; nothing here reads either, and W&B from
Levanter's configs is run by test_lora's Levanter config and tracker-wandb's tests.)"""

import math
import os
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parents[5] / "shared" / "levanter-configs" / "config"
CONFIGS = [
    "gpt2_small_sophiah.yaml",  # optimizer: !include optim/sophia-h_small.yaml
    "gpt2_small_fast_sophiah.yaml",
    "gpt2_small_fast_sophia_h.yaml",
    "gpt2_1536_sophiah.yaml",
    "gpt2_large_sophia_h.yaml",
    "gpt2_small_fast_muon.yaml",
]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """One token cache for the runs: their data sections are the same."""
    return tmp_path_factory.mktemp("stdlib-cache")


@pytest.mark.slow
@pytest.mark.skipif(not REFERENCE.is_dir(), reason=f"Levanter's configs are not at {REFERENCE}")
@pytest.mark.parametrize("name", CONFIGS)
def test_levanter_optimizer_config_trains(name, tmp_path, data_cache):
    from levanter_core.config.train import load_train_config
    from levanter_core.run import run_training

    overrides = [
        "--data", f"{{type: python_stdlib, tokenizer: byte, max_files: 12, cache_dir: {data_cache}}}",
        "--model.hidden_dim", "32", "--model.num_heads", "2", "--model.num_layers", "2", "--model.seq_len", "64",
        "--model.gradient_checkpointing", "false",
        "--trainer.train_batch_size", "4", "--trainer.num_train_steps", "8", "--trainer.steps_per_eval", "8",
        "--trainer.max_eval_batches", "1", "--trainer.mp", "p=f32", "--trainer.id", "run",
        "--trainer.wandb", "null", "--trainer.tracker", "{type: json}", "--trainer.log_dir", str(tmp_path / "logs"),
        "--trainer.checkpointer.base_path", str(tmp_path / "ckpt"),
        "--optimizer.warmup", "2",
    ]  # fmt: skip
    config, _ = load_train_config(str(REFERENCE / name), overrides)  # (null: no deprecated trainer.wandb either)
    assert config.optimizer.type in ("sophia-h", "muon")
    result = run_training(config, progress=False)
    assert result.final_step == 8 and math.isfinite(result.last_loss)
    assert result.last_loss < result.first_loss, (result.first_loss, result.last_loss)
    assert result.checkpoint and os.path.exists(os.path.join(result.checkpoint, "COMMITTED"))
