"""OLMo 2 and OLMo 3 against Hugging Face transformers (logits after import and export,
stacked and unrolled, greedy decoding, settings we refuse), training from the nano configs and
discovery, through :class:`~levanter_core.testing.model_family.ModelFamilyTests`; then what only
OLMo has (OLMo 3's two rotations and layer pattern, the unscanned checkpoint layout)."""

import json
import os
from functools import partial

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from levanter_core.hf import to_hf_state_dict  # noqa: E402
from levanter_core.hf.bridge import config_from_hf, export_hf, import_hf, load_hf_model  # noqa: E402
from levanter_core.hf.convert import from_hf_state_dict  # noqa: E402
from levanter_core.hf.parity import hf_logits, our_logits, random_hf_model  # noqa: E402
from levanter_core.layers import DefaultRotaryConfig, YarnRotaryConfig  # noqa: E402
from levanter_core.testing import TINY_HF, tiny_hf_config  # noqa: E402
from levanter_core.testing.model_family import ModelFamilyTests  # noqa: E402
from levanter_model_olmo.olmo2 import Olmo2Config  # noqa: E402
from levanter_model_olmo.olmo3 import Olmo3Config  # noqa: E402

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


def olmo2_config(variant: str):
    return tiny_hf_config(transformers.Olmo2Config, **VARIANTS[variant])


def olmo3_config(variant: str):
    # Olmo3Config's default eos id lies outside a tiny vocabulary
    return tiny_hf_config(transformers.Olmo3Config, **OLMO3_VARIANTS[variant], eos_token_id=2, pad_token_id=1)


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
    tokens = np.random.default_rng(0).integers(0, TINY_HF["vocab_size"], size=(2, 24))
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
    return lambda: {**tiny_hf_config(transformers.Olmo2Config).to_dict(), **keys}


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


class TestOlmoFamilies(ModelFamilyTests):
    hf_configs = {
        **{f"olmo2-{name}": partial(olmo2_config, name) for name in VARIANTS},
        **{f"olmo3-{name}": partial(olmo3_config, name) for name in OLMO3_VARIANTS},
    }
    # the translated OLMo 3 config carries no special token ids; the export's comparison checks them
    without_special_tokens = frozenset(name for name in hf_configs if name.startswith("olmo3-"))
    unrolled = ("olmo2-gqa_llama3_bias", "olmo3-pattern_yarn_full")
    generation = ("olmo2-gqa_llama3_bias", "olmo3-pattern_yarn_full")
    refused = REFUSED
    package = "levanter_model_olmo"
    nano_configs = ("olmo2_nano.yaml", "olmo3_nano.yaml")
    golden_losses = "assets/losses"  # the 20-step loss curve of each (levanter_core.testing.golden)
    distribution = "levanter-model-olmo"
    types = {"model": ["olmo2", "olmo3"]}
