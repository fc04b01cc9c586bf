"""gpt-oss against Hugging Face transformers (logits after import and export, stacked and
unstacked; the load-balancing loss), training from the nano config, and discovery."""

import os

import pytest
import transformers

from levanter_core.hf.parity import check_hf_parity, load_balancing_losses, random_hf_model
from levanter_core.testing import listed_plugin, train_briefly

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    num_local_experts=4,
    num_experts_per_tok=2,
    # a window (8) shorter than the 24 compared positions; sliding and full layers in turn
    sliding_window=8,
)

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}  # fmt: skip

HF_CONFIGS = {
    "alternating-yarn": lambda: transformers.GptOssConfig(**TINY, rope_parameters=YARN),
    # a small limit clamps many gate and up values, so the clamp is exercised
    "all-full-clamped-tied": lambda: transformers.GptOssConfig(
        **TINY, layer_types=["full_attention", "full_attention"], swiglu_limit=0.5, tie_word_embeddings=True
    ),
    "three-layers-top1": lambda: transformers.GptOssConfig(
        **{**TINY, "num_hidden_layers": 3, "num_experts_per_tok": 1},
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    ),
}


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_matches_hugging_face(name, tmp_path):
    check_hf_parity(HF_CONFIGS[name](), str(tmp_path)).assert_matches()


def test_unrolled_layers_match_hugging_face(tmp_path):
    check_hf_parity(HF_CONFIGS["alternating-yarn"](), str(tmp_path), scan_layers=False).assert_matches(configs=False)


def test_checkpoint_holds_sinks_and_interleaved_experts(tmp_path):
    from levanter_core.hf.checkpoint import HfCheckpoint

    random_hf_model(HF_CONFIGS["alternating-yarn"]()).save_pretrained(str(tmp_path))
    stored = {name: tuple(t.shape) for name, t in HfCheckpoint(str(tmp_path)).tensors.items()}
    assert stored["model.layers.1.self_attn.sinks"] == (4,)
    assert stored["model.layers.1.mlp.experts.gate_up_proj"] == (4, 64, 96)
    assert stored["model.layers.1.mlp.router.bias"] == (4,)


def test_load_balancing_loss_is_hugging_faces(tmp_path):
    ours, theirs, _ = load_balancing_losses(HF_CONFIGS["alternating-yarn"](), str(tmp_path))
    assert abs(ours - theirs) <= 1e-5 and abs(ours - 2.0) > 1e-3  # not uniform routing's value


@pytest.mark.slow
def test_nano_config_trains(tmp_path):
    result = train_briefly(os.path.join(CONFIGS, "gpt_oss_nano.yaml"), str(tmp_path))
    assert result.final_eval_loss < result.initial_eval_loss


def test_discovered_through_its_entry_point():
    ours = listed_plugin("levanter-model-gpt-oss")
    assert ours["error"] is None and ours["types"] == {"model": ["gpt_oss"]}
    assert set(ours["hooks"]) == {"register_models", "model_type_for_hf_config"}