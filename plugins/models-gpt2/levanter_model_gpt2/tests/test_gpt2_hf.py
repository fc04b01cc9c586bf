"""GPT-2 against Hugging Face's ``GPT2LMHeadModel``: import, export and the config translation,
with stacked and unrolled layers, and greedy decoding, through
:class:`~levanter_core.testing.model_family.HfParityTests`; then GPT-2's own checkpoints and
refusals."""

import json
import os
from functools import partial

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from levanter_core.errors import CheckpointError  # noqa: E402
from levanter_core.hf.bridge import export_hf, import_hf, load_hf_model  # noqa: E402
from levanter_core.hf.parity import hf_logits, our_logits, random_hf_model  # noqa: E402
from levanter_core.testing.model_family import HfParityTests  # noqa: E402
from levanter_model_gpt2.gpt2 import Gpt2Config  # noqa: E402

TINY = {"vocab_size": 128, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}

VARIANTS = {
    "gpt2": {},
    # a narrower MLP (n_inner = 2 * n_embd), ReLU, another epsilon, and layer i's scores
    # divided by i + 1: each would change the logits far beyond the tolerance if ignored
    "mistral-tweaks": {
        "n_inner": 128,
        "activation_function": "relu",
        "layer_norm_epsilon": 1e-3,
        "scale_attn_by_inverse_layer_idx": True,
    },
    "upcast": {"reorder_and_upcast_attn": True, "activation_function": "gelu"},
}


class TestGpt2(HfParityTests):
    # GPT-2's keys (n_embd, n_layer, ...) are not the tiny decoder's: its own tiny sizes
    hf_configs = {name: partial(transformers.GPT2Config, **TINY, **variant) for name, variant in VARIANTS.items()}
    unrolled = tuple(VARIANTS)
    generation = ("gpt2",)


def test_a_base_model_checkpoint_with_mask_buffers(tmp_path):
    """The original ``gpt2`` on the hub was saved from ``GPT2Model``: its tensors have no
    ``transformer.`` prefix, and each layer carries its causal mask (``attn.bias``,
    ``attn.masked_bias``) as a tensor. It loads as it is."""
    import torch
    from safetensors.torch import load_file, save_file

    theirs = random_hf_model(transformers.GPT2Config(**TINY))
    directory = tmp_path / "base"
    theirs.transformer.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    assert "wte.weight" in tensors and not any(name.startswith("transformer.") for name in tensors)
    for i in range(TINY["n_layer"]):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})

    loaded = load_hf_model(str(directory))
    tokens = np.random.default_rng(0).integers(0, TINY["vocab_size"], size=(2, 16))
    assert np.max(np.abs(our_logits(loaded.model, tokens) - hf_logits(theirs, tokens))) <= 1e-4


def test_our_checkpoint_names_are_unchanged():
    """The Hugging Face names are a mapping at export: a run's own checkpoints keep the
    module paths they always had (``transformer.blocks``, ``embeddings.token_embeddings``)."""
    import jax
    from haliax import Axis

    from levanter_core.checkpoint.tensorstore import _flatten

    config = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16)
    model = config.build(Axis("vocab", 50), key=jax.random.PRNGKey(0))
    _, _, names = _flatten({"model": model})
    assert "model/embeddings/token_embeddings/weight" in names
    assert "model/transformer/blocks/stacked/attn/c_attn/weight" in names


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tie_word_embeddings": False}, "tie_word_embeddings: false is not supported"),
        ({"n_inner": 100}, r"n_inner \(100\) must be a multiple of n_embd \(64\)"),
        ({"scale_attn_weights": False}, "scale_attn_weights: false is not supported"),
    ],
)
def test_unsupported_settings_are_named(change, message, tmp_path):
    random_hf_model(transformers.GPT2Config(**TINY)).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(CheckpointError, match=message):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))


def test_a_model_without_biases_is_not_exported(tmp_path):
    import jax
    from haliax import Axis

    from levanter_core.checkpoint import write_checkpoint

    config = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16, use_bias=False)
    model = config.build(Axis("vocab", 50), key=jax.random.PRNGKey(0))
    metadata = {"config": {"model": config.model_dump(mode="json")}, "vocab_size": 50}
    checkpoint = write_checkpoint({"model": model}, str(tmp_path / "ckpt"), step=0, metadata=metadata)
    with pytest.raises(CheckpointError, match="use_bias: false has no Hugging Face GPT-2 equivalent"):
        export_hf(checkpoint, str(tmp_path / "exported"))
    assert not os.path.exists(tmp_path / "exported" / "config.json")
