"""gpt-oss against Hugging Face transformers (logits after import and export, stacked and
unstacked, greedy decoding, settings we refuse), training from the nano config, and discovery,
through :class:`~levanter_core.testing.model_family.ModelFamilyTests`; then what only gpt-oss has
(sinks and interleaved experts in the checkpoint, the balancing loss, its defaults)."""

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from levanter_core.hf.bridge import config_from_hf  # noqa: E402
from levanter_core.hf.checkpoint import HfCheckpoint  # noqa: E402
from levanter_core.hf.parity import load_balancing_losses, random_hf_model  # noqa: E402
from levanter_core.layers import YarnRotaryConfig  # noqa: E402
from levanter_core.testing import TINY_HF  # noqa: E402
from levanter_core.testing.model_family import ModelFamilyTests  # noqa: E402
from levanter_model_gpt_oss.gpt_oss import GptOssConfig  # noqa: E402

TINY = {
    **TINY_HF,
    "intermediate_size": 48,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    # a window (8) shorter than the 24 compared positions; sliding and full layers in turn
    "sliding_window": 8,
}

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}  # fmt: skip

HF_CONFIGS = {
    "alternating-yarn": lambda: transformers.GptOssConfig(**TINY, rope_parameters=YARN),
    # a small limit clamps many gate and up values, so the clamp is exercised
    "all-full-clamped-tied": lambda: transformers.GptOssConfig(
        **TINY, layer_types=["full_attention", "full_attention"], swiglu_limit=0.5, tie_word_embeddings=True
    ),
    "three-layers-top1-no-bias": lambda: transformers.GptOssConfig(
        **{**TINY, "num_hidden_layers": 3, "num_experts_per_tok": 1},
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        attention_bias=False,
    ),
}


def test_checkpoint_holds_sinks_and_interleaved_experts(tmp_path):
    random_hf_model(HF_CONFIGS["alternating-yarn"]()).save_pretrained(str(tmp_path))
    stored = {name: tuple(t.shape) for name, t in HfCheckpoint(str(tmp_path)).tensors.items()}
    assert stored["model.layers.1.self_attn.sinks"] == (4,)
    assert stored["model.layers.1.mlp.experts.gate_up_proj"] == (4, 64, 96)
    assert stored["model.layers.1.mlp.router.bias"] == (4,)


def test_load_balancing_loss_is_hugging_faces(tmp_path):
    ours, theirs, _ = load_balancing_losses(HF_CONFIGS["alternating-yarn"](), str(tmp_path))
    assert abs(ours - theirs) <= 1e-5 and abs(ours - 2.0) > 1e-3  # not uniform routing's value


def test_absent_keys_read_as_transformers_reads_them():
    # no head_dim, no rope_parameters: transformers assumes 64 and gpt-oss's own YaRN, not
    # hidden_size / num_attention_heads and plain RoPE
    bare = {k: v for k, v in TINY.items() if k != "head_dim"}
    theirs = transformers.GptOssConfig(**bare)
    ours = config_from_hf({"model_type": "gpt_oss", **bare, "rope_theta": 5000.0})
    assert ours.actual_head_dim == theirs.head_dim == 64
    assert ours.rope == YarnRotaryConfig(
        theta=5000.0, factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False
    )
    assert theirs.rope_parameters["rope_type"] == "yarn" and theirs.rope_parameters["factor"] == 32.0


# gpt-oss-20b's config.json (its quantization_config left out), in the older rope_scaling form
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088, "eos_token_id": 200002, "pad_token_id": 199999,
}  # fmt: skip


def test_defaults_are_gpt_oss_20bs():
    ours, imported = GptOssConfig(), config_from_hf(GPT_OSS_20B)
    assert imported.model_dump(exclude={"layer_types"}) == ours.model_dump(exclude={"layer_types"})
    assert imported.attention_types() == ours.attention_types()


REFUSED = {
    # OpenAI's published checkpoints store the experts in MXFP4 blocks and scales
    "quantization_config: the experts are stored quantized (mxfp4)": {
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    },
    "attention_dropout: 0.1 is not supported": {"attention_dropout": 0.1},
    "partial_rotary_factor = 0.5 is not supported": {"partial_rotary_factor": 0.5},
    "rope type 'proportional' is not supported": {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
}


def test_jax_backend_is_refused_before_it_meets_the_sinks():
    with pytest.raises(ValueError, match="attn_backend 'jax' cannot add attention sinks"):
        GptOssConfig(attn_backend="jax")


def _refused_with(keys: dict):
    """A config.json's dict of the tiny gpt-oss with ``keys`` set."""
    return lambda: {"model_type": "gpt_oss", **TINY, **keys}


class TestGptOss(ModelFamilyTests):
    hf_configs = HF_CONFIGS
    unrolled = ("alternating-yarn",)
    generation = ("alternating-yarn",)
    refused = {message: _refused_with(keys) for message, keys in REFUSED.items()}
    package = "levanter_model_gpt_oss"
    nano_configs = ("gpt_oss_nano.yaml",)
    golden_losses = "assets/losses"  # the 20-step loss curve of each (levanter_core.testing.golden)
    distribution = "levanter-model-gpt-oss"
    types = {"model": ["gpt_oss"]}
