"""Qwen 2 and Qwen 3 against Hugging Face transformers, training from the nano configs, and
discovery through the entry point."""

import math
import os
import re

import pytest
import transformers

from levanter_core.errors import CheckpointError
from levanter_core.hf.bridge import config_from_hf
from levanter_core.hf.parity import check_hf_parity, load_balancing_losses
from levanter_core.testing import listed_plugin, train_briefly
from levanter_model_qwen3.qwen import QwenConfig

# the nano configs ship inside the package, beside these tests
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# check_hf_parity compares logits over 24 positions, so a window of 8 is exercised.
HF_CONFIGS = {
    "qwen": lambda: transformers.Qwen2Config(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen-tied": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    # layer 0 full, layers 1 and 2 sliding: a per-layer switch scanned with the layers
    "qwen-sliding": lambda: transformers.Qwen2Config(
        **{**TINY, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    # head_dim 32 x 4 heads: the query projection is twice as wide as the residual stream
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32),
    # every layer sliding (a fixed window), and biases on all four projections
    "qwen3-sliding-bias": lambda: transformers.Qwen3Config(
        **TINY, head_dim=16, attention_bias=True, use_sliding_window=True, sliding_window=8, max_window_layers=0
    ),
    # dynamic NTK scaling past a context of 16: the 24 compared positions grow the base
    "qwen3-dynamic-rope": lambda: transformers.Qwen3Config(
        **{**TINY, "max_position_embeddings": 16},
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
    ),
}


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_matches_hugging_face(name, tmp_path):
    check_hf_parity(HF_CONFIGS[name](), str(tmp_path)).assert_matches()


def test_unsupported_layer_pattern_is_rejected_by_name():
    hf = transformers.Qwen2Config(
        **TINY, use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
    ).to_dict()
    with pytest.raises(ValueError, match="layer_types .* max_window_layers"):
        QwenConfig.from_hf_config(hf)


@pytest.mark.slow
@pytest.mark.parametrize("config_file", ["qwen_nano.yaml", "qwen3_nano.yaml", "qwen3_moe_nano.yaml"])
def test_nano_config_trains(config_file, tmp_path):
    result = train_briefly(os.path.join(CONFIGS, config_file), str(tmp_path))
    assert result.final_step == 4
    assert math.isfinite(result.first_loss) and math.isfinite(result.last_loss)
    assert result.final_eval_loss < result.initial_eval_loss


def test_discovered_through_its_entry_point():
    ours = listed_plugin("levanter-model-qwen3")
    assert ours["error"] is None and ours["types"] == {"model": ["qwen", "qwen3", "qwen3_moe"]}
    assert set(ours["hooks"]) == {"register_models", "model_type_for_hf_config"}


# scan_layers: false builds the layers unrolled (hnn.BlockSeq); the per-layer sliding switch
# and Qwen 3's head norms are the parts that differ from the scanned path
@pytest.mark.parametrize("name", ["qwen-sliding", "qwen3"])
def test_unrolled_layers_match_hugging_face(name, tmp_path):
    check_hf_parity(HF_CONFIGS[name](), str(tmp_path), scan_layers=False).assert_matches(configs=False)


REFUSED = {
    # rotating only half of each head: transformers' Qwen would rotate all of it anyway
    "partial_rotary_factor = 0.5 is not supported: Hugging Face's Qwen2ForCausalLM rotates whole heads": (
        lambda: transformers.Qwen2Config(**TINY, partial_rotary_factor=0.5)
    ),
}


@pytest.mark.parametrize("message", REFUSED)
def test_unsupported_settings_are_refused_by_name(message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_hf(REFUSED[message]().to_dict())


# -- Qwen3-MoE ------------------------------------------------------------------------------------

MOE = dict(TINY, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

MOE_CONFIGS = {
    "moe-normalized": lambda: transformers.Qwen3MoeConfig(**MOE, norm_topk_prob=True),
    # layers 1 and 3 are sparse by the step, 3 is dense by mlp_only_layers: dense, moe, dense, dense
    "moe-sparse-step": lambda: transformers.Qwen3MoeConfig(
        **{**MOE, "num_hidden_layers": 4}, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False
    ),
    "moe-sliding-tied": lambda: transformers.Qwen3MoeConfig(
        **MOE, use_sliding_window=True, sliding_window=8, tie_word_embeddings=True, norm_topk_prob=True
    ),
}


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_qwen3_moe_matches_hugging_face(name, tmp_path):
    check_hf_parity(MOE_CONFIGS[name](), str(tmp_path)).assert_matches()


def test_qwen3_moe_unrolled_layers_match_hugging_face(tmp_path):
    check_hf_parity(MOE_CONFIGS["moe-sparse-step"](), str(tmp_path), scan_layers=False).assert_matches(configs=False)


def test_qwen3_moe_load_balancing_loss_is_hugging_faces(tmp_path):
    hf_config = MOE_CONFIGS["moe-normalized"]()
    ours, theirs, weighted = load_balancing_losses(hf_config, str(tmp_path))
    assert abs(ours - theirs) <= 1e-5 and abs(ours - 2.0) > 1e-3  # not uniform routing's value
    assert weighted == pytest.approx(hf_config.router_aux_loss_coef * ours, rel=1e-6)
