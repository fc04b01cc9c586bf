"""``export-hf`` of a run with ``trainer.model_averaging`` exports the averaged weights, the ones
evaluation used; ``--raw-weights`` exports the trained weights instead."""

import json
import os

import jax
import numpy as np
import pytest
from haliax import Axis
from safetensors.numpy import load_file

from conftest import run_cli

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from levanter_model_gpt2.gpt2 import Gpt2Config  # noqa: E402

from levanter_core.checkpoint import write_checkpoint  # noqa: E402
from levanter_core.hf.parity import hf_logits, our_logits  # noqa: E402

VOCAB = 257
CONFIG = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=2, seq_len=32)


def exported_tensors(directory: str) -> dict[str, np.ndarray]:
    tensors = {}
    for file in os.listdir(directory):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, file)))
    return tensors


def export(checkpoint: str, output: str, *flags: str) -> str:
    result = run_cli("export-hf", checkpoint, output, *flags)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_the_average_is_exported_unless_raw_weights_are_asked_for(tmp_path):
    # a training state as the trainer saves it: the model, and the average beside it
    trained = CONFIG.build(Axis("vocab", VOCAB), key=jax.random.PRNGKey(0))
    average = CONFIG.build(Axis("vocab", VOCAB), key=jax.random.PRNGKey(1))
    metadata = {"config": {"model": CONFIG.model_dump(mode="json"), "data": {"tokenizer": "byte"}}, "vocab_size": VOCAB}
    checkpoint = str(tmp_path / "ckpt" / "step-3")
    write_checkpoint({"model": trained, "model_averaging": {"model": average}}, checkpoint, step=3, metadata=metadata)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 16))

    log = export(checkpoint, str(tmp_path / "averaged"))
    assert "averaged weights" in log
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "averaged"), attn_implementation="eager"
    )
    np.testing.assert_allclose(hf_logits(reloaded, tokens), our_logits(average, tokens), atol=1e-4)

    export(checkpoint, str(tmp_path / "raw"), "--raw-weights")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "raw"), attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(reloaded, tokens), our_logits(trained, tokens), atol=1e-4)


@pytest.mark.slow
def test_a_trained_run_exports_what_evaluation_used(tmp_path):
    from levanter_core.config.loader import Sources
    from levanter_core.config.train import validate_train_config
    from levanter_core.run import run_training

    raw = {
        "data": {"type": "python_stdlib", "tokenizer": "byte", "max_files": 5, "cache_dir": str(tmp_path / "cache")},
        "model": {"type": "gpt2", "hidden_dim": 32, "num_heads": 2, "num_layers": 1, "seq_len": 32},
        "trainer": {"id": "avg", "num_train_steps": 4, "train_batch_size": 4, "steps_per_eval": 4, "max_eval_batches": 1,
                    "log_dir": str(tmp_path / "logs"), "checkpointer": {"base_path": str(tmp_path / "ckpt")},
                    "model_averaging": {"type": "ema", "beta": 0.5}},
        "optimizer": {"learning_rate": 3e-2, "warmup": 0},
    }  # fmt: skip
    result = run_training(validate_train_config(raw, Sources("run.yaml")), progress=False)

    averaged, raw_weights = str(tmp_path / "averaged"), str(tmp_path / "raw")
    export(result.checkpoint, averaged)
    export(result.checkpoint, raw_weights, "--raw-weights")
    name = "transformer.wte.weight"
    stored = {
        part: np.asarray(_stored(result.checkpoint, f"{part}/embeddings/token_embeddings/weight"))
        for part in ("model", "model_averaging/model")
    }
    assert not np.allclose(stored["model"], stored["model_averaging/model"])
    np.testing.assert_array_equal(exported_tensors(averaged)[name], stored["model_averaging/model"])
    np.testing.assert_array_equal(exported_tensors(raw_weights)[name], stored["model"])
    with open(os.path.join(averaged, "config.json")) as f:
        assert json.load(f)["eos_token_id"] == 256


def _stored(checkpoint: str, name: str):
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(checkpoint, name)}}
    return ts.open(spec).result().read().result()
