"""Gemma, Gemma 2 and Gemma 3 against Hugging Face transformers (logits after import and export,
stacked and unrolled, greedy decoding, settings we refuse), training from the nano configs and
discovery, through :class:`~levanter_core.testing.model_family.ModelFamilyTests`; then what only
Gemma has (the embedding scale's rounding, soft caps in the loss, Gemma 3's older keys)."""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from levanter_core.errors import CheckpointError  # noqa: E402
from levanter_core.hf.bridge import config_from_hf  # noqa: E402
from levanter_core.models.lm import next_token_loss  # noqa: E402
from levanter_core.testing import TINY_HF, tiny_hf_config  # noqa: E402
from levanter_core.testing.model_family import ModelFamilyTests  # noqa: E402
from levanter_model_gemma.gemma import embedding_scale  # noqa: E402
from levanter_model_gemma.gemma2 import Gemma2Config  # noqa: E402

# The parity checks compare 24 positions, three times the sliding window of 8, so that windows truncate.
WINDOW = 8

LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

VARIANTS = {
    # multi-query attention, head_dim unrelated to hidden / heads, tied head
    "gemma_mqa": lambda: tiny_hf_config(
        transformers.GemmaConfig, num_hidden_layers=2, num_key_value_heads=1, head_dim=24
    ),
    "gemma_gqa_untied_bias": lambda: tiny_hf_config(
        transformers.GemmaConfig,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    # default soft caps (50 / 30) and layer types (even layers local)
    "gemma2_gqa": lambda: tiny_hf_config(
        transformers.Gemma2Config,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=32,
        sliding_window=WINDOW,
    ),
    # caps small enough to bend the scores and logits of a random model
    "gemma2_mqa_tight_caps": lambda: tiny_hf_config(
        transformers.Gemma2Config,
        num_hidden_layers=3,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        attn_logit_softcapping=0.5,
        final_logit_softcapping=1.0,
    ),
    # linearly scaled global RoPE, base 1e4 local RoPE
    "gemma3_gqa_linear_rope": lambda: tiny_hf_config(
        transformers.Gemma3TextConfig,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=32,
        sliding_window=WINDOW,
        layer_types=LOCAL_GLOBAL,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    ),
    "gemma3_mqa_final_cap": lambda: tiny_hf_config(
        transformers.Gemma3TextConfig,
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=LOCAL_GLOBAL[:2],
        final_logit_softcapping=1.0,
    ),
    # every layer global, with a window configured that none of them uses
    "gemma2_all_global": lambda: tiny_hf_config(
        transformers.Gemma2Config,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["full_attention", "full_attention"],
    ),
    # every layer local: one fixed window, and every layer rotates with the local base
    "gemma3_all_local": lambda: tiny_hf_config(
        transformers.Gemma3TextConfig,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
}


def _with_rope_type(hf_config, rope_type: str) -> dict:
    hf = hf_config.to_dict()
    hf["rope_parameters"]["rope_type"] = rope_type  # one transformers may know and we do not
    return hf


def _two_layers(config_class, **keys) -> dict:
    """A tiny two-layer config of ``config_class`` with ``keys``, as a config.json's dict."""
    return tiny_hf_config(config_class, num_hidden_layers=2, **keys).to_dict()


REFUSED = {
    "partial_rotary_factor = 0.5 is not supported: Hugging Face's GemmaForCausalLM": lambda: _two_layers(
        transformers.GemmaConfig, partial_rotary_factor=0.5
    ),
    # Gemma 2
    "rope type 'proportional' is not supported": lambda: _with_rope_type(
        tiny_hf_config(transformers.Gemma2Config, num_hidden_layers=2), "proportional"
    ),
    "partial_rotary_factor = 0.5 is not supported: Hugging Face's Gemma3ForCausalLM": lambda: _two_layers(
        transformers.Gemma3TextConfig, partial_rotary_factor=0.5
    ),
    "rope_parameters.sliding_attention: rope type 'dynamic' is not supported": lambda: _two_layers(
        transformers.Gemma3TextConfig,
        rope_parameters={
            "sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
    ),
    # Gemma 3 embedding models: attention that sees the whole sequence, no causal mask
    "use_bidirectional_attention: true is not supported": lambda: _two_layers(
        transformers.Gemma3TextConfig, use_bidirectional_attention=True
    ),
    # Gemma 2
    "attention_dropout: 0.1 is not supported": lambda: _two_layers(transformers.Gemma2Config, attention_dropout=0.1),
}


@pytest.mark.parametrize("hidden", [1152, 2048, 2304, 3072, 3584, 4608])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_embedding_scale_is_rounded_as_transformers_rounds_it(hidden, dtype):
    theirs = torch.tensor(hidden**0.5).to(getattr(torch, dtype)).float().item()
    assert float(embedding_scale(hidden, jnp.dtype(dtype))) == theirs


def test_training_loss_sees_the_final_soft_cap():
    config = Gemma2Config(
        seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=0.5,
    )  # fmt: skip
    Vocab = hax.Axis("vocab", 32)
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    ids = hax.random.randint(jax.random.PRNGKey(1), (hax.Axis("batch", 2), config.Pos), 0, Vocab.size)
    # the logits and the training loss from one compiled program (one compile, not two)
    logits, loss = eqx.filter_jit(lambda m, x: (m(x), next_token_loss(m, x)))(model, ids)
    logits = np.asarray(logits.rearrange(("batch", "position", "vocab")).array)
    assert np.abs(logits).max() <= 0.5  # capped
    log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    targets = ids.array[:, 1:]
    expected = -np.mean(np.take_along_axis(np.asarray(log_probs), np.asarray(targets)[..., None], -1))
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def test_legacy_gemma3_config_reads_local_theta_scaling_and_pattern():
    config = config_from_hf(
        {
            "model_type": "gemma3_text",
            **TINY_HF,
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 20000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window_pattern": 2,
        }
    )
    assert config.type == "gemma3"
    assert (config.rope.type, config.rope.theta, config.rope.factor) == ("linear", 1000000.0, 8.0)
    assert config.rope_local_base_freq == 20000.0
    assert config.resolved_layer_types() == tuple(LOCAL_GLOBAL)


def test_multimodal_gemma3_is_refused_with_an_explanation():
    with pytest.raises(CheckpointError, match="gemma3_text"):
        config_from_hf({"model_type": "gemma3", "text_config": {}, "vision_config": {}})


class TestGemmaFamilies(ModelFamilyTests):
    hf_configs = VARIANTS
    # scan_layers: false (hnn.BlockSeq): the per-layer sliding flags and Gemma 3's two rotary
    # embeddings reach every unrolled layer
    unrolled = ("gemma_mqa", "gemma2_mqa_tight_caps", "gemma3_gqa_linear_rope")
    generation = ("gemma_mqa", "gemma2_mqa_tight_caps", "gemma3_gqa_linear_rope")
    refused = REFUSED
    package = "levanter_model_gemma"
    nano_configs = ("gemma_nano.yaml", "gemma2_nano.yaml", "gemma3_nano.yaml")
    golden_losses = "assets/losses"  # the 20-step loss curve of each (levanter_core.testing.golden)
    # batches of 4 sequences rather than 16: the loss still falls, in a third less time
    nano_overrides = ("--trainer.train_batch_size", "4")
    distribution = "levanter-model-gemma"
    types = {"model": ["gemma", "gemma2", "gemma3"]}
