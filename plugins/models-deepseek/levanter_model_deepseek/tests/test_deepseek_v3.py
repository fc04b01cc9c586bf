"""DeepSeek-V3 against Hugging Face transformers (logits after import and export, stacked and
unstacked, greedy decoding, a rotary type we refuse), training from the nano config, and
discovery, through :class:`~levanter_core.testing.model_family.ModelFamilyTests`."""

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from levanter_core.testing import tiny_hf_config  # noqa: E402
from levanter_core.testing.model_family import ModelFamilyTests  # noqa: E402

# on the tiny decoder: three layers of four key-value heads and a dense MLP of width 96
DEEPSEEK = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_key_value_heads=4,
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


def deepseek(**keys):
    return tiny_hf_config(transformers.DeepseekV3Config, **{**DEEPSEEK, **keys})


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip

HF_CONFIGS = {
    # a latent for the queries, group-limited routing, one dense layer, YaRN with mscale
    "q-latent-groups-yarn": lambda: deepseek(rope_parameters=YARN),
    # queries straight from the hidden state, no renormalization, two dense layers, tied
    "q-proj-unnormalized-tied": lambda: deepseek(
        q_lora_rank=None,
        first_k_dense_replace=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        tie_word_embeddings=True,
    ),
    # the rotated dimensions in plain halves, biases on the projections, two shared experts
    "halves-bias-shared": lambda: deepseek(
        n_shared_experts=2, rope_interleave=False, attention_bias=True, routed_scaling_factor=1.5
    ),
}


def _perturbed_correction_bias(model):
    """transformers initializes e_score_correction_bias to zeros (a buffer the random
    perturbation skips): give it values so the routing depends on it."""
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


def _proportional_rope() -> dict:
    hf = HF_CONFIGS["q-latent-groups-yarn"]().to_dict()
    hf["rope_parameters"]["rope_type"] = "proportional"
    return hf


class TestDeepseekV3(ModelFamilyTests):
    hf_configs = HF_CONFIGS
    unrolled = ("q-latent-groups-yarn",)
    generation = ("q-latent-groups-yarn", "q-proj-unnormalized-tied")
    refused = {"rope type 'proportional' is not supported": _proportional_rope}
    package = "levanter_model_deepseek"
    nano_configs = ("deepseek_v3_nano.yaml",)
    golden_losses = "assets/losses"  # the 20-step loss curve of each (levanter_core.testing.golden)
    distribution = "levanter-model-deepseek"
    types = {"model": ["deepseek_v3"]}
