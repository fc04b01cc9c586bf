"""Qwen 2, Qwen 3 and Qwen3-MoE against Hugging Face transformers (logits after import and
export, stacked and unrolled, greedy decoding, settings we refuse), training from the nano
configs and discovery, through :class:`~levanter_core.testing.model_family.ModelFamilyTests`;
then what only Qwen3-MoE has (its head_dim default, the older experts key, the balancing loss)."""

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from levanter_core.hf.bridge import config_from_hf  # noqa: E402
from levanter_core.hf.parity import check_hf_parity, load_balancing_losses  # noqa: E402
from levanter_core.testing import TINY_HF, tiny_hf_config  # noqa: E402
from levanter_core.testing.model_family import ModelFamilyTests  # noqa: E402
from levanter_model_qwen3.qwen3_moe import Qwen3MoeConfig  # noqa: E402

# Qwen3-MoE: 4 experts of width 32, 2 per token. head_dim 32 (not hidden_size // heads), as in
# the released models, where the attention is wider than the residual stream.
MOE = {**TINY_HF, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def qwen2(**keys):
    return tiny_hf_config(transformers.Qwen2Config, **keys)


def qwen3(**keys):
    return tiny_hf_config(transformers.Qwen3Config, **keys)


def qwen3_moe(**keys):
    return transformers.Qwen3MoeConfig(**{**MOE, **keys})


# check_hf_parity compares logits over 24 positions, so a window of 8 is exercised.
HF_CONFIGS = {
    "qwen": lambda: qwen2(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen-tied": lambda: qwen2(tie_word_embeddings=True),
    # layer 0 full, layers 1 and 2 sliding: a per-layer switch scanned with the layers
    "qwen-sliding": lambda: qwen2(num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    # head_dim 32 x 4 heads: the query projection is twice as wide as the residual stream
    "qwen3": lambda: qwen3(head_dim=32),
    # every layer sliding (a fixed window), and biases on all four projections
    "qwen3-sliding-bias": lambda: qwen3(
        head_dim=16, attention_bias=True, use_sliding_window=True, sliding_window=8, max_window_layers=0
    ),
    # dynamic NTK scaling past a context of 16: the 24 compared positions grow the base
    "qwen3-dynamic-rope": lambda: qwen3(
        max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}
    ),
}

MOE_CONFIGS = {
    "moe-normalized": lambda: qwen3_moe(norm_topk_prob=True),
    # layers 1 and 3 are sparse by the step, 3 is dense by mlp_only_layers: dense, moe, dense, dense
    "moe-sparse-step": lambda: qwen3_moe(
        num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False
    ),
    # moe, dense, moe (three groups of layers); every layer sliding; biases; tied embeddings
    "moe-sliding-bias-tied": lambda: qwen3_moe(
        num_hidden_layers=3,
        mlp_only_layers=[1],
        use_sliding_window=True,
        sliding_window=8,
        attention_bias=True,
        tie_word_embeddings=True,
        norm_topk_prob=True,
    ),
}

ALL_CONFIGS = {**HF_CONFIGS, **MOE_CONFIGS}


def test_qwen3_moe_without_head_dim_splits_the_hidden_size(tmp_path):
    # Qwen3MoeConfig, unlike Qwen3Config, has no head_dim default of 128: without the key the
    # heads are hidden_size // num_attention_heads wide. The export writes the key explicitly.
    hf_config = transformers.Qwen3MoeConfig(**{k: v for k, v in MOE.items() if k != "head_dim"})
    assert config_from_hf(hf_config.to_dict()).head_dim == 16
    report = check_hf_parity(hf_config, str(tmp_path))
    assert report.import_max_abs_diff <= 1e-4 and report.export_max_abs_diff <= 1e-4
    assert report.config_differences == report.export_config_differences == {"head_dim": (None, 16)}


def test_qwen3_moe_defaults_are_qwen3_30b_a3b_as_transformers_reads_them():
    hf = transformers.AutoConfig.for_model(**Qwen3MoeConfig().to_hf_config(151936))
    shape = (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert shape == (2048, 48, 32, 4, 128)
    experts = (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.norm_topk_prob, hf.mlp_only_layers)
    assert experts == (128, 8, 768, True, [])
    assert (hf.max_position_embeddings, hf.rope_parameters["rope_theta"], hf.sliding_window) == (40960, 1e6, None)


def test_qwen3_moe_reads_the_older_num_experts_key():
    hf = qwen3_moe().to_dict()
    del hf["num_local_experts"]
    assert config_from_hf({**hf, "num_experts": 4}).num_experts == 4


def test_qwen3_moe_load_balancing_loss_is_hugging_faces(tmp_path):
    hf_config = MOE_CONFIGS["moe-normalized"]()
    ours, theirs, weighted = load_balancing_losses(hf_config, str(tmp_path))
    assert abs(ours - theirs) <= 1e-5 and abs(ours - 2.0) > 1e-3  # not uniform routing's value
    assert weighted == pytest.approx(hf_config.router_aux_loss_coef * ours, rel=1e-6)


def _with(make, **keys):
    """A Hugging Face config as a dict, with ``keys`` set as a config.json could have them."""
    return lambda: {**make().to_dict(), **keys}


REFUSED = {
    # rotating only part of each head: transformers' Qwen would rotate all of it anyway
    "partial_rotary_factor = 0.5 is not supported: Hugging Face's Qwen2ForCausalLM rotates whole heads": (
        lambda: qwen2(partial_rotary_factor=0.5).to_dict()
    ),
    "partial_rotary_factor = 0.25 is not supported: Hugging Face's Qwen3MoeForCausalLM rotates whole heads": (
        lambda: qwen3_moe(partial_rotary_factor=0.25).to_dict()
    ),
    # a pattern of sliding layers that use_sliding_window and max_window_layers cannot say
    "layer_types ['sliding_attention', 'full_attention'] is not supported": _with(
        lambda: qwen2(use_sliding_window=True, sliding_window=8), layer_types=["sliding_attention", "full_attention"]
    ),
    "attention_dropout: 0.1 is not supported": _with(qwen3, attention_dropout=0.1),
    "rope type 'proportional' is not supported": _with(
        qwen3, rope_parameters={"rope_type": "proportional", "rope_theta": 1e6}
    ),
    # no experts: transformers would build every layer dense (type qwen3 is that model)
    "num_experts\n  Input should be greater than 0": _with(qwen3_moe, num_local_experts=0),
    "attention_dropout: 0.2 is not supported": _with(qwen3_moe, attention_dropout=0.2),
}


class TestQwenFamilies(ModelFamilyTests):
    hf_configs = ALL_CONFIGS
    # scan_layers: false builds the layers unrolled (hnn.BlockSeq): the per-layer sliding switch,
    # Qwen 3's head norms, and the groups of dense and sparse layers are what differ from the stack
    unrolled = ("qwen-sliding", "qwen3", "moe-sparse-step", "moe-sliding-bias-tied")
    generation = ("qwen-sliding", "qwen3", "moe-sparse-step")
    refused = REFUSED
    package = "levanter_model_qwen3"
    nano_configs = ("qwen_nano.yaml", "qwen3_nano.yaml", "qwen3_moe_nano.yaml")
    golden_losses = "assets/losses"  # the 20-step loss curve of each (levanter_core.testing.golden)
    distribution = "levanter-model-qwen3"
    types = {"model": ["qwen", "qwen3", "qwen3_moe"]}
