"""Reading Hugging Face's rotary settings: what transformers computes from a whole
``config.json``, or a refusal that names the setting."""

import numpy as np
import pytest

from levanter_core.layers import DefaultRotaryConfig, rotary_from_hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

TINY = dict(hidden_size=128, num_attention_heads=2, max_position_embeddings=256)


def _transformers_frequencies(hf_config: dict, seq_len: int | None = None):
    """transformers' inverse frequencies and attention factor for a Llama ``config.json`` (64
    dimensions per head), for a sequence of ``seq_len`` positions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**hf_config)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        dim = int(64 * config.rope_parameters.get("partial_rotary_factor", 1.0))
        return 1.0 / (config.rope_parameters["rope_theta"] ** (np.arange(0, dim, 2) / dim)), 1.0
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    return inv_freq.numpy(), scale


LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + i / 32 for i in range(32)],
    "long_factor": [2.0 + i / 8 for i in range(32)],
    "original_max_position_embeddings": 64,
}


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
    "extra, seq_len",
    [
        # rotating part of each head: in the dictionary, or at the top level
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, None),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "partial_rotary_factor": 0.25}, None),
        # dynamic NTK: plain within max_position_embeddings, a larger base past it
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 100),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 1000),
        # LongRoPE: the short factors up to the original length, the long ones past it
        ({"rope_parameters": LONGROPE}, 64),
        ({"rope_parameters": LONGROPE}, 65),
        ({"rope_parameters": {**LONGROPE, "attention_factor": 1.5}, "partial_rotary_factor": 1.0}, 300),
    ],
)
def test_partial_and_length_dependent_rotations_match_transformers(extra, seq_len):
    hf_config = {**TINY, **extra}
    expected, scale = _transformers_frequencies(hf_config, seq_len)
    ours = rotary_from_hf(dict(hf_config["rope_parameters"]), hf_config=hf_config)
    dim = ours.rotary_dim(64)
    assert dim == len(expected) * 2
    np.testing.assert_allclose(ours.inverse_frequencies(dim, seq_len=seq_len), expected, rtol=1e-6)
    assert ours.table_scale(seq_len) == pytest.approx(scale)


@pytest.mark.parametrize(
    "params, hf_config, message",
    [
        ({"rope_type": "proportional"}, {}, "rope type 'proportional' is not supported"),
        ({"type": "axial"}, {}, "rope type 'axial' is not supported"),
        ({"rope_type": "yarn", "factor": None}, {}, "rope_parameters.factor is null for yarn"),
    ],
)
def test_what_we_do_not_implement_is_refused_by_name(params, hf_config, message):
    with pytest.raises(ValueError, match=message):
        rotary_from_hf(params, hf_config=hf_config)


def test_levanters_default_factor_is_not_read_from_hugging_face():
    assert rotary_from_hf({"rope_type": "default", "factor": 4.0, "rope_theta": 5e5}) == DefaultRotaryConfig(theta=5e5)
