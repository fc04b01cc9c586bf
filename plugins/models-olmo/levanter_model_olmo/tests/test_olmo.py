"""OLMo 2 and OLMo 3 against Hugging Face transformers (logits after import and export, the
config's round trip, settings we refuse), training from the nano configs, and discovery
through the entry point."""

import json
import math
import os
import re

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest
import transformers

from levanter_core.errors import CheckpointError
from levanter_core.hf import to_hf_state_dict
from levanter_core.hf.bridge import config_from_hf, export_hf, import_hf, load_hf_model
from levanter_core.hf.convert import from_hf_state_dict
from levanter_core.hf.parity import check_hf_parity, hf_logits, our_logits, random_hf_model, check_generation_parity
from levanter_core.layers import DefaultRotaryConfig, YarnRotaryConfig
from levanter_core.testing import listed_plugin, train_briefly
from levanter_model_olmo.olmo2 import Olmo2Config
from levanter_model_olmo.olmo3 import Olmo3Config

# the nano configs ship inside the package, beside these tests
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}

VARIANTS = {
    "mha": {"num_key_value_heads": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "gqa_llama3_bias": {
        "num_key_value_heads": 2,
        "attention_bias": True,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    "gqa_yarn_tied": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16.0,  # not the default, so it must survive the round trip
        },
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity_with_transformers(variant, tmp_path):
    check_hf_parity(transformers.Olmo2Config(**COMMON, **VARIANTS[variant]), str(tmp_path)).assert_matches()


# OLMo 3: the window (8) is shorter than the 24 compared positions, and the two kinds of
# layer rotate differently, so a layer that slid wrongly or used the other rotation shows
OLMO3_VARIANTS = {
    # Hugging Face's default pattern: layers 0-2 sliding, layer 3 full
    "default_pattern": {"num_hidden_layers": 4, "num_key_value_heads": 2, "sliding_window": 8},
    "pattern_yarn_full": {
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 5e5,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    },
    "all_sliding_bias_tied": {
        "num_key_value_heads": 4,
        "sliding_window": 8,
        "attention_bias": True,
        "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    },
}


def olmo3_config(variant: str):
    # Olmo3Config's default eos id lies outside a tiny vocabulary
    return transformers.Olmo3Config(**{**COMMON, **OLMO3_VARIANTS[variant]}, eos_token_id=2, pad_token_id=1)


@pytest.mark.parametrize("variant", sorted(OLMO3_VARIANTS))
def test_olmo3_parity_with_transformers(variant, tmp_path):
    check_hf_parity(olmo3_config(variant), str(tmp_path)).assert_matches(special_tokens=False)


@pytest.mark.parametrize(
    "hf_config",
    [
        lambda: transformers.Olmo2Config(**COMMON, **VARIANTS["gqa_llama3_bias"]),
        lambda: olmo3_config("pattern_yarn_full"),
    ],
)
def test_unrolled_layers_match_transformers(hf_config, tmp_path):
    check_hf_parity(hf_config(), str(tmp_path), scan_layers=False).assert_matches(configs=False)


def test_olmo3_refuses_a_layer_pattern_of_the_wrong_length():
    with pytest.raises(ValueError, match="layer_types has 3 entries but num_layers is 2"):
        Olmo3Config(num_layers=2, layer_types=("full_attention",) * 3)


def test_olmo3_reads_an_older_files_rope_scaling_for_the_full_layers_only(tmp_path):
    # a config.json of transformers 4: rope_theta at the top, the YaRN scaling in rope_scaling.
    # transformers 5 gives both to the full layers; the sliding ones rotate plainly by 500000.
    source, imported, exported = (str(tmp_path / d) for d in ("hf", "imported", "exported"))
    random_hf_model(olmo3_config("default_pattern"), seed=1).save_pretrained(source)
    path = os.path.join(source, "config.json")
    with open(path) as f:
        hf = json.load(f)
    del hf["rope_parameters"]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    with open(path, "w") as f:
        json.dump({**hf, "rope_theta": 1e4, "rope_scaling": yarn}, f)

    theirs = transformers.AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
    tokens = np.random.default_rng(0).integers(0, COMMON["vocab_size"], size=(2, 24))
    expected = hf_logits(theirs, tokens)
    loaded = load_hf_model(source)
    assert loaded.config.rope == YarnRotaryConfig(theta=1e4, factor=4.0, original_max_position_embeddings=16)
    assert loaded.config.sliding_rope == DefaultRotaryConfig(theta=5e5)
    assert np.max(np.abs(our_logits(loaded.model, tokens) - expected)) <= 1e-4

    export_hf(import_hf(source, imported), exported, max_shard_bytes=64 * 1024)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    assert np.max(np.abs(hf_logits(reloaded, tokens) - expected)) <= 1e-4


def test_olmo3_defaults_are_what_transformers_reads_back():
    # OLMo 3 7B: YaRN from 8,192 to 65,536 tokens in the full layers, plain RoPE in the sliding ones
    ours = Olmo3Config()
    back = config_from_hf(transformers.AutoConfig.for_model(**ours.to_hf_config(100278)).to_dict())
    assert back.rope == ours.rope == YarnRotaryConfig(theta=5e5, factor=8.0, original_max_position_embeddings=8192)
    assert back.sliding_rope == ours.sliding_rope == DefaultRotaryConfig(theta=5e5)
    assert back.attention_types() == ours.attention_types() == (("sliding_attention",) * 3 + ("full_attention",)) * 8
    assert back.sliding_window == ours.sliding_window == 4096 and back.seq_len == 65536


def _olmo2(**keys):
    return lambda: {**transformers.Olmo2Config(**COMMON, num_key_value_heads=2).to_dict(), **keys}


def _olmo3(variant="default_pattern", **keys):
    return lambda: {**olmo3_config(variant).to_dict(), **keys}


REFUSED = {
    "partial_rotary_factor = 0.5 is not supported": _olmo2(partial_rotary_factor=0.5),
    "rope type 'proportional' is not supported": _olmo2(
        rope_parameters={"rope_type": "proportional", "rope_theta": 5e5}
    ),
    "attention_dropout: 0.1 is not supported": _olmo2(attention_dropout=0.1),
    # OLMo 3: each kind of layer's rotation is checked
    "partial_rotary_factor = 0.25 is not supported: Hugging Face's Olmo3ForCausalLM rotates whole heads": _olmo3(
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        }
    ),
    # transformers would ignore a single dictionary and rotate every layer plainly
    "is a single rotary embedding": _olmo3(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}),
    # pydantic's messages, naming our field and the entry
    "layer_types.1\n  Input should be 'full_attention' or 'sliding_attention'": _olmo3(
        layer_types=["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]
    ),
    "sliding_window\n  Input should be a valid integer": _olmo3(sliding_window=None),
    "attention_dropout: 0.1 is not supported (a Olmo3Config": _olmo3(attention_dropout=0.1),
}


@pytest.mark.parametrize("message", REFUSED)
def test_unsupported_settings_are_refused_by_name(message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_hf(REFUSED[message]())


@pytest.mark.slow
@pytest.mark.parametrize("config_file", ["olmo2_nano.yaml", "olmo3_nano.yaml"])
def test_nano_config_trains(config_file, tmp_path):
    result = train_briefly(os.path.join(CONFIGS, config_file), str(tmp_path))
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        losses = [record["train/loss"] for record in map(json.loads, f) if "train/loss" in record]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert result.final_eval_loss < result.initial_eval_loss


def test_unscanned_layers_have_the_same_checkpoint_layout():
    config = Olmo2Config(seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    Vocab = hax.Axis("vocab", 64)
    scanned = config.build(Vocab, key=jax.random.PRNGKey(0))
    state_dict = to_hf_state_dict(scanned)

    unscanned_config = config.model_copy(update={"scan_layers": False})
    template = eqx.filter_eval_shape(lambda: unscanned_config.build(Vocab, key=jax.random.PRNGKey(1)))
    unscanned = from_hf_state_dict(template, state_dict)

    assert to_hf_state_dict(unscanned).keys() == state_dict.keys()
    ids = hax.random.randint(jax.random.PRNGKey(2), (hax.Axis("batch", 2), config.Pos), 0, Vocab.size)
    forward = eqx.filter_jit(lambda model, ids: model(ids))
    np.testing.assert_allclose(forward(unscanned, ids).array, forward(scanned, ids).array, atol=1e-5)


def test_discovered_through_its_entry_point():
    ours = listed_plugin("levanter-model-olmo")
    assert ours["error"] is None and ours["types"] == {"model": ["olmo2", "olmo3"]}
    assert set(ours["hooks"]) == {"register_models", "model_type_for_hf_config"}


# Greedy decoding through the engine's key/value cache, three prompts of different lengths in
# one batch, 48 new tokens each: the same tokens as transformers' generate
@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_greedy_decoding_matches_transformers_generate(name, tmp_path):
    check_generation_parity({"olmo2": lambda: transformers.Olmo2Config(**COMMON, **VARIANTS["gqa_llama3_bias"]), "olmo3": lambda: olmo3_config("pattern_yarn_full")}[name](), str(tmp_path)).assert_matches()
