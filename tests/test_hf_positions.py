"""A GPT-2 base trained on sequences shorter than its positions (``max_train_length``) uses the
first rows of its learned position embeddings, as Levanter does; a longer ``seq_len`` than the
base has positions is an exit-2 error naming the setting and the base's positions."""

import json

import numpy as np
import pytest
from haliax import Axis

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from levanter_core.errors import CheckpointError  # noqa: E402
from levanter_core.hf import load_hf_weights  # noqa: E402
from levanter_core.hf.bridge import config_from_hf, read_hf_config  # noqa: E402
from levanter_core.hf.checkpoint import HfCheckpoint  # noqa: E402
from levanter_core.hf.parity import hf_logits, our_logits, random_hf_model  # noqa: E402

POSITIONS, VOCAB = 64, 257  # the byte tokenizer's 256 bytes and its end of text


@pytest.fixture(scope="module")
def gpt2_base(tmp_path_factory) -> tuple[str, object]:
    from levanter_core.data.tokenizer import ByteTokenizer

    directory = tmp_path_factory.mktemp("gpt2-base")
    hf_model = random_hf_model(
        transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=POSITIONS, vocab_size=VOCAB)
    )
    hf_model.save_pretrained(directory)
    (directory / "tokenizer.json").write_text(ByteTokenizer().to_tokenizer_json())
    return str(directory), hf_model


def test_a_shorter_seq_len_loads_the_first_positions(gpt2_base):
    directory, hf_model = gpt2_base
    config = config_from_hf(read_hf_config(directory)).model_copy(update={"seq_len": 16})
    model = load_hf_weights(config, Axis("vocab", VOCAB), HfCheckpoint(directory))
    wpe = hf_model.transformer.wpe.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(model.embeddings.position_embeddings.weight.array), wpe[:16])
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 16))
    np.testing.assert_allclose(our_logits(model, tokens), hf_logits(hf_model, tokens), atol=1e-4)


def test_a_longer_seq_len_names_the_setting_and_the_positions(gpt2_base):
    directory, _ = gpt2_base
    config = config_from_hf(read_hf_config(directory)).model_copy(update={"seq_len": 2 * POSITIONS})
    with pytest.raises(CheckpointError) as raised:
        load_hf_weights(config, Axis("vocab", VOCAB), HfCheckpoint(directory))
    message = str(raised.value)
    assert "max_train_length" in message and "model.seq_len is 128" in message and f"{POSITIONS} positions" in message
    assert raised.value.exit_code == 2


def test_fine_tuning_a_gpt2_base_with_a_shorter_max_train_length(gpt2_base, tmp_path):
    """The journey that failed on ``wpe.weight expected [16,32] found [64,32]``."""
    from levanter_core.config.train import load_train_config
    from levanter_core.run import run_training
    from levanter_core.testing import code_docs, write_jsonl

    directory, _ = gpt2_base
    config = {
        "data": {"tokenizer": "byte", "train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(20))],
                 "cache_dir": str(tmp_path / "cache")},
        "trainer": {"id": "short", "train_batch_size": 4, "num_train_steps": 2, "steps_per_eval": 100,
                    "log_dir": str(tmp_path / "logs"), "checkpointer": {"base_path": str(tmp_path / "ckpt"), "keep": []}},
        "optimizer": {"learning_rate": 1e-3, "warmup": 0.0},
        "initialize_from_hf": directory,  # no model section: the base's architecture, 64 positions
        "max_train_length": 16,
    }  # fmt: skip
    path = tmp_path / "short.yaml"
    path.write_text(json.dumps(config))
    loaded, _ = load_train_config(str(path))
    assert loaded.model.seq_len == 16
    result = run_training(loaded, config_path=str(path), progress=False)
    assert result.final_step == 2 and np.isfinite(result.last_loss)
