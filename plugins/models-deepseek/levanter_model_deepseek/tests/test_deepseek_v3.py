"""DeepSeek-V3 against Hugging Face transformers (logits after import and export, stacked and
unstacked), training from the nano config, and discovery."""

import os

import pytest
import transformers

from levanter_core.errors import CheckpointError
from levanter_core.hf.bridge import config_from_hf
from levanter_core.hf.parity import check_hf_parity, check_generation_parity
from levanter_core.testing import listed_plugin, train_briefly

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    # transformers' default ids lie outside a tiny vocabulary
    bos_token_id=0,
    eos_token_id=1,
)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip

HF_CONFIGS = {
    # a latent for the queries, group-limited routing, one dense layer, YaRN with mscale
    "q-latent-groups-yarn": lambda: transformers.DeepseekV3Config(**TINY, rope_parameters=YARN),
    # queries straight from the hidden state, no renormalization, two dense layers, tied
    "q-proj-unnormalized-tied": lambda: transformers.DeepseekV3Config(
        **{**TINY, "q_lora_rank": None, "first_k_dense_replace": 2, "n_group": 1, "topk_group": 1},
        norm_topk_prob=False, tie_word_embeddings=True,
    ),  # fmt: skip
    # the rotated dimensions in plain halves, biases on the projections, two shared experts
    "halves-bias-shared": lambda: transformers.DeepseekV3Config(
        **{**TINY, "n_shared_experts": 2}, rope_interleave=False, attention_bias=True, routed_scaling_factor=1.5
    ),
}


def _perturbed_correction_bias(model):
    """transformers initializes e_score_correction_bias to zeros (a buffer the random
    perturbation skips): give it values so the routing depends on it."""
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model


@pytest.fixture(autouse=True)
def correction_bias(monkeypatch):
    from levanter_core.hf import parity

    original = parity.random_hf_model
    monkeypatch.setattr(parity, "random_hf_model", lambda *a, **k: _perturbed_correction_bias(original(*a, **k)))


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_matches_hugging_face(name, tmp_path):
    check_hf_parity(HF_CONFIGS[name](), str(tmp_path)).assert_matches()


def test_unrolled_layers_match_hugging_face(tmp_path):
    report = check_hf_parity(HF_CONFIGS["q-latent-groups-yarn"](), str(tmp_path), scan_layers=False)
    report.assert_matches(configs=False)


def test_unsupported_rotary_type_is_refused_by_name():
    hf = HF_CONFIGS["q-latent-groups-yarn"]().to_dict()
    hf["rope_parameters"]["rope_type"] = "proportional"
    with pytest.raises(CheckpointError, match="rope type 'proportional' is not supported"):
        config_from_hf(hf)


@pytest.mark.slow
def test_nano_config_trains(tmp_path):
    result = train_briefly(os.path.join(CONFIGS, "deepseek_v3_nano.yaml"), str(tmp_path))
    assert result.final_eval_loss < result.initial_eval_loss


def test_discovered_through_its_entry_point():
    ours = listed_plugin("levanter-model-deepseek")
    assert ours["error"] is None and ours["types"] == {"model": ["deepseek_v3"]}
    assert set(ours["hooks"]) == {"register_models", "model_type_for_hf_config"}


# Greedy decoding through the engine's key/value cache, three prompts of different lengths in
# one batch, 48 new tokens each: the same tokens as transformers' generate
@pytest.mark.parametrize("name", ["q-latent-groups-yarn", "q-proj-unnormalized-tied"])
def test_greedy_decoding_matches_transformers_generate(name, tmp_path):
    check_generation_parity(HF_CONFIGS[name](), str(tmp_path)).assert_matches()
