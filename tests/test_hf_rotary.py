"""Reading Hugging Face's rotary settings: what transformers computes from a whole
``config.json``, or a refusal that names the setting."""

import numpy as np
import pytest

from levanter_core.layers import DefaultRotaryConfig, rotary_from_hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

TINY = dict(hidden_size=128, num_attention_heads=2, max_position_embeddings=256)


def _transformers_frequencies(hf_config: dict):
    """transformers' inverse frequencies and attention factor for a Llama ``config.json``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**hf_config)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return 1.0 / (config.rope_parameters["rope_theta"] ** (np.arange(0, 64, 2) / 64)), 1.0
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.numpy(), scale


@pytest.mark.parametrize(
    "extra",
    [
        # transformers fills a missing original length from max_position_embeddings
        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
        # a null YaRN factor is max_position_embeddings / original_max_position_embeddings
        {"rope_parameters": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}},
        # a top-level original length wins over the dictionary's
        {
            "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128},
            "original_max_position_embeddings": 32,
        },
        # the plain rotation ignores a factor, as transformers does
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "factor": 4.0}},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "partial_rotary_factor": 1.0},
    ],
)
def test_whole_config_gives_transformers_frequencies(extra):
    hf_config = {**TINY, **extra}
    expected, scale = _transformers_frequencies(hf_config)
    ours = rotary_from_hf(dict(hf_config["rope_parameters"]), hf_config=hf_config)
    np.testing.assert_allclose(ours.inverse_frequencies(64), expected, rtol=1e-6)
    assert ours.table_scale() == pytest.approx(scale)


@pytest.mark.parametrize(
    "params, hf_config, message",
    [
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, {}, "rope_parameters.partial_rotary_factor = 0.5"),
        ({"rope_type": "linear", "factor": 2.0}, {"partial_rotary_factor": 0.25}, "partial_rotary_factor = 0.25"),
        ({"rope_type": "dynamic", "factor": 2.0}, {}, "rope type 'dynamic' is not supported"),
        ({"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, {}, "rope type 'longrope' is not supported"),
        ({"rope_type": "yarn", "factor": None}, {}, "rope_parameters.factor is null for yarn"),
    ],
)
def test_what_we_do_not_implement_is_refused_by_name(params, hf_config, message):
    with pytest.raises(ValueError, match=message):
        rotary_from_hf(params, hf_config=hf_config)


def test_levanters_default_factor_is_not_read_from_hugging_face():
    assert rotary_from_hf({"rope_type": "default", "factor": 4.0, "rope_theta": 5e5}) == DefaultRotaryConfig(theta=5e5)
