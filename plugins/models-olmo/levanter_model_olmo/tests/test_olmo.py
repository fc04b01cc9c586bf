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
from levanter_core.hf.convert import from_hf_state_dict
from levanter_core.hf.bridge import config_from_hf
from levanter_core.hf.parity import check_hf_parity
from levanter_core.testing import listed_plugin, train_briefly
from levanter_model_olmo.olmo2 import Olmo2Config
from levanter_model_olmo.olmo3 import Olmo3Config

# the nano configs ship inside the package, beside these tests
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)

VARIANTS = {
    "mha": dict(num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "gqa_llama3_bias": dict(
        num_key_value_heads=2,
        attention_bias=True,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "gqa_yarn_tied": dict(
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16.0,  # not the default, so it must survive the round trip
        },
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity_with_transformers(variant, tmp_path):
    check_hf_parity(transformers.Olmo2Config(**COMMON, **VARIANTS[variant]), str(tmp_path)).assert_matches()



# OLMo 3: the window (8) is shorter than the 24 compared positions, and the two kinds of
# layer rotate differently, so a layer that slid wrongly or used the other rotation shows
OLMO3_VARIANTS = {
    # Hugging Face's default pattern: layers 0-2 sliding, layer 3 full
    "default_pattern": dict(num_hidden_layers=4, num_key_value_heads=2, sliding_window=8),
    "pattern_yarn_full": dict(
        num_hidden_layers=3,
        num_key_value_heads=2,
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                               "original_max_position_embeddings": 16},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),  # fmt: skip
    "all_sliding_bias_tied": dict(
        num_key_value_heads=4,
        sliding_window=8,
        attention_bias=True,
        tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
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


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),
        (dict(rope_parameters={"rope_type": "proportional", "rope_theta": 5e5}), "rope type 'proportional'"),
    ],
)
def test_unsupported_rotary_settings_are_refused_by_name(overrides, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_hf(transformers.Olmo2Config(**COMMON, num_key_value_heads=2, **overrides).to_dict())

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