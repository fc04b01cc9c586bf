"""Llama, Mistral and Phi-3 against Hugging Face transformers (logits after import and export,
stacked and unrolled, greedy decoding, settings we refuse), training from the nano configs
and discovery, through :class:`~levanter_core.testing.model_family.ModelFamilyTests`; then
what only these families have (older files' rotary keys, Mistral's window default)."""

import json
import os
from functools import partial

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from levanter_core.hf.bridge import config_from_hf, export_hf, import_hf, load_hf_model  # noqa: E402
from levanter_core.hf.parity import IGNORED_CONFIG_KEYS, hf_logits, our_logits, random_hf_model  # noqa: E402
from levanter_core.layers import LinearRotaryConfig, Llama3RotaryConfig  # noqa: E402
from levanter_core.testing import TINY_HF, tiny_hf_config  # noqa: E402
from levanter_core.testing.model_family import ModelFamilyTests  # noqa: E402

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # shorter than the parity sequences, so that the scaled frequencies matter
    "original_max_position_embeddings": 16,
}

LLAMA_VARIANTS = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(),
    "mqa": dict(num_key_value_heads=1),
    "tied": dict(tie_word_embeddings=True),
    "rope_llama3": dict(rope_parameters=LLAMA3_ROPE),
    "rope_yarn": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "rope_linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "attention_bias": dict(attention_bias=True),
    "head_dim_32": dict(head_dim=32),
    # LongRoPE: the 24 compared positions exceed the original 16, so the long factors apply,
    # and the attention temperature follows from 256 / 16
    "rope_longrope": dict(
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)],
            "original_max_position_embeddings": 16,
        }
    ),
    # dynamic NTK: 24 positions past max_position_embeddings 16 grow the base wavelength
    "rope_dynamic": dict(
        max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    ),
}

MISTRAL_VARIANTS = {
    "sliding_window_8": dict(sliding_window=8),
    "no_sliding_window": dict(sliding_window=None),
}


PHI3_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(4)],
    "long_factor": [2.0 + 0.5 * i for i in range(4)],
    "original_max_position_embeddings": 16,
}
PHI3_VARIANTS = {
    "fused": dict(),
    # half of each head rotates, the other half passes through
    "partial_rotary": dict(partial_rotary_factor=0.5),
    # LongRoPE past its original length, on the rotating half of each head
    "longrope_partial": dict(
        partial_rotary_factor=0.5, original_max_position_embeddings=16, rope_parameters=PHI3_LONGROPE
    ),
    "sliding_window_8": dict(sliding_window=8),
    "tied": dict(tie_word_embeddings=True),
}


def llama_config(**variant):
    return tiny_hf_config(transformers.LlamaConfig, **variant)


def mistral_config(**variant):
    return tiny_hf_config(transformers.MistralConfig, **variant)


def phi3_config(**variant):
    # Phi3Config's default pad id (32000) lies outside a tiny vocabulary, which torch refuses
    return tiny_hf_config(transformers.Phi3Config, pad_token_id=0, bos_token_id=1, eos_token_id=2, **variant)


def _proportional_rope() -> dict:
    hf = mistral_config().to_dict()
    hf["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 1e4}
    return hf


class TestLlamaFamilies(ModelFamilyTests):
    hf_configs = {
        **{f"llama-{name}": partial(llama_config, **variant) for name, variant in LLAMA_VARIANTS.items()},
        # Phi-3: fused qkv_proj and gate_up_proj in every variant
        **{f"phi3-{name}": partial(phi3_config, **variant) for name, variant in PHI3_VARIANTS.items()},
        **{f"mistral-{name}": partial(mistral_config, **variant) for name, variant in MISTRAL_VARIANTS.items()},
    }
    # the translated Phi-3 config carries no special token ids; the export's comparison checks them
    without_special_tokens = frozenset(name for name in hf_configs if name.startswith("phi3-"))
    # scan_layers: false builds the layers unrolled (hnn.BlockSeq): loading, saving and exporting
    # them must give the same tensors and logits as the scanned stack
    unrolled = ("llama-attention_bias", "mistral-sliding_window_8", "phi3-longrope_partial")
    generation = ("llama-rope_llama3", "mistral-sliding_window_8", "phi3-partial_rotary")
    refused = {
        "rope type 'proportional' is not supported": _proportional_rope,
        # transformers' Llama cannot rotate part of a head
        "partial_rotary_factor = 0.5 is not supported": lambda: llama_config(partial_rotary_factor=0.5).to_dict(),
        "mlp_bias: true is not supported": lambda: llama_config(mlp_bias=True).to_dict(),
    }
    package = "levanter_model_llama"
    nano_configs = ("llama_nano.yaml", "mistral_nano.yaml")
    golden_losses = "assets/losses"  # the 20-step loss curve of each (levanter_core.testing.golden)
    distribution = "levanter-model-llama"
    types = {"model": ["llama", "mistral", "phi3"]}


LEGACY_ROPE = {
    # Llama 3.1's config.json: rope_theta at the top, the scaling in rope_scaling
    "llama3": (
        {"rope_theta": 500000.0, "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}},
        Llama3RotaryConfig(**{k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}),
    ),
    # older files name the scaling with "type"
    "linear_type_key": (
        {"rope_theta": 20000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
        LinearRotaryConfig(theta=20000.0, factor=2.0),
    ),
}


@pytest.mark.parametrize("variant", LEGACY_ROPE)
def test_llama_reads_legacy_rope_keys(variant, tmp_path):
    legacy_keys, expected_rope = LEGACY_ROPE[variant]
    source, imported, exported = (str(tmp_path / d) for d in ("hf", "imported", "exported"))
    random_hf_model(llama_config(), seed=1).save_pretrained(source)
    config_path = os.path.join(source, "config.json")
    with open(config_path) as f:
        hf_config = json.load(f)
    del hf_config["rope_parameters"]
    with open(config_path, "w") as f:
        json.dump({**hf_config, **legacy_keys}, f)

    theirs = transformers.AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
    tokens = np.random.default_rng(0).integers(0, TINY_HF["vocab_size"], size=(2, 24))
    expected = hf_logits(theirs, tokens)

    loaded = load_hf_model(source)
    assert loaded.config.rope == expected_rope
    assert np.max(np.abs(our_logits(loaded.model, tokens) - expected)) <= 1e-4

    export_hf(import_hf(source, imported), exported, max_shard_bytes=64 * 1024)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    assert np.max(np.abs(hf_logits(reloaded, tokens) - expected)) <= 1e-4
    before = transformers.AutoConfig.from_pretrained(source).to_dict()
    after = transformers.AutoConfig.from_pretrained(exported).to_dict()
    assert _comparable(before) == _comparable(after)


def _comparable(hf_config: dict) -> dict:
    """The config without file metadata, and without the legacy ``type`` alias that
    transformers keeps beside ``rope_type`` when it reads an old file (the export writes
    only ``rope_type``)."""
    config = {k: v for k, v in hf_config.items() if k not in IGNORED_CONFIG_KEYS}
    config["rope_parameters"] = {k: v for k, v in config["rope_parameters"].items() if k != "type"}
    return config


def test_mistral_without_a_sliding_window_key_gets_transformers_default():
    hf = mistral_config().to_dict()
    del hf["sliding_window"]
    assert config_from_hf(hf).sliding_window == mistral_config().sliding_window == 4096


def test_scaled_rope_without_original_length_uses_the_context_length():
    # transformers fills original_max_position_embeddings from max_position_embeddings
    hf = llama_config(rope_parameters=dict(LLAMA3_ROPE)).to_dict()
    del hf["rope_parameters"]["original_max_position_embeddings"]
    assert config_from_hf(hf).rope.original_max_position_embeddings == TINY_HF["max_position_embeddings"]
