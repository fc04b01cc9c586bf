import json
import math
import os
import re

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from levanter_core.errors import CheckpointError
from levanter_core.hf.bridge import config_from_hf
from levanter_core.hf.parity import check_hf_parity, check_generation_parity
from levanter_core.models.lm import next_token_loss
from levanter_core.testing import listed_plugin, train_briefly
from levanter_model_gemma.gemma import embedding_scale
from levanter_model_gemma.gemma2 import Gemma2Config

# the nano configs ship inside the package, beside these tests
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}

# Sequences of 24 tokens, three times the sliding window of 8, so that windows truncate.
SEQ_LEN = 24
WINDOW = 8

LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

VARIANTS = {
    # multi-query attention, head_dim unrelated to hidden / heads, tied head
    "gemma_mqa": lambda: transformers.GemmaConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=1, head_dim=24),
    "gemma_gqa_untied_bias": lambda: transformers.GemmaConfig(
        **COMMON,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    # default soft caps (50 / 30) and layer types (even layers local)
    "gemma2_gqa": lambda: transformers.Gemma2Config(
        **COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=32,
        sliding_window=WINDOW,
    ),
    # caps small enough to bend the scores and logits of a random model
    "gemma2_mqa_tight_caps": lambda: transformers.Gemma2Config(
        **COMMON,
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
    "gemma3_gqa_linear_rope": lambda: transformers.Gemma3TextConfig(
        **COMMON,
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
    "gemma3_mqa_final_cap": lambda: transformers.Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=LOCAL_GLOBAL[:2],
        final_logit_softcapping=1.0,
    ),
    # every layer global, with a window configured that none of them uses
    "gemma2_all_global": lambda: transformers.Gemma2Config(
        **COMMON,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["full_attention", "full_attention"],
    ),
    # every layer local: one fixed window, and every layer rotates with the local base
    "gemma3_all_local": lambda: transformers.Gemma3TextConfig(
        **COMMON,
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


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity_with_transformers(variant, tmp_path):
    report = check_hf_parity(VARIANTS[variant](), str(tmp_path), seq_len=SEQ_LEN)
    report.assert_matches()
    assert report.shards > 1


# scan_layers: false (hnn.BlockSeq): the per-layer sliding flags and Gemma 3's two rotary
# embeddings reach every unrolled layer
@pytest.mark.parametrize("variant", ["gemma_mqa", "gemma2_mqa_tight_caps", "gemma3_gqa_linear_rope"])
def test_unrolled_layers_match_transformers(variant, tmp_path):
    check_hf_parity(VARIANTS[variant](), str(tmp_path), seq_len=SEQ_LEN, scan_layers=False).assert_matches()


def _with_rope_type(hf_config, rope_type: str) -> dict:
    hf = hf_config.to_dict()
    hf["rope_parameters"]["rope_type"] = rope_type  # one transformers may know and we do not
    return hf


REFUSED = {
    "gemma: partial_rotary_factor = 0.5": lambda: transformers.GemmaConfig(
        **COMMON, num_hidden_layers=2, partial_rotary_factor=0.5
    ).to_dict(),
    "gemma2: rope type 'proportional' is not supported": lambda: _with_rope_type(
        transformers.Gemma2Config(**COMMON, num_hidden_layers=2), "proportional"
    ),
    "gemma3: partial_rotary_factor = 0.5": lambda: transformers.Gemma3TextConfig(
        **COMMON, num_hidden_layers=2, partial_rotary_factor=0.5
    ).to_dict(),
    "gemma3: rope_parameters.sliding_attention: rope type 'dynamic' is not supported": lambda: (
        transformers.Gemma3TextConfig(
            **COMMON,
            num_hidden_layers=2,
            rope_parameters={
                "sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
        ).to_dict()
    ),
    # embedding models: attention that sees the whole sequence, no causal mask
    "gemma3: use_bidirectional_attention: true is not supported": lambda: transformers.Gemma3TextConfig(
        **COMMON, num_hidden_layers=2, use_bidirectional_attention=True
    ).to_dict(),
    "gemma2: attention_dropout: 0.1 is not supported": lambda: transformers.Gemma2Config(
        **COMMON, num_hidden_layers=2, attention_dropout=0.1
    ).to_dict(),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_settings_are_refused_by_name(case):
    message = case.split(": ", 1)[1]
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_hf(REFUSED[case]())


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
    logits = eqx.filter_jit(lambda m, x: m(x))(model, ids).rearrange(("batch", "position", "vocab")).array
    assert np.abs(logits).max() <= 0.5  # capped
    log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    targets = ids.array[:, 1:]
    expected = -np.mean(np.take_along_axis(np.asarray(log_probs), np.asarray(targets)[..., None], -1))
    np.testing.assert_allclose(float(eqx.filter_jit(next_token_loss)(model, ids)), expected, rtol=1e-5)


def test_legacy_gemma3_config_reads_local_theta_scaling_and_pattern():
    config = config_from_hf(
        {
            "model_type": "gemma3_text",
            **COMMON,
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


def test_discovered_through_its_entry_point():
    ours = listed_plugin("levanter-model-gemma")
    assert ours["error"] is None and ours["types"] == {"model": ["gemma", "gemma2", "gemma3"]}
    assert set(ours["hooks"]) == {"register_models", "model_type_for_hf_config"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_nano_config_trains(name, tmp_path):
    # batches of 4 sequences rather than 16: the loss still falls, in a third less time
    overrides = ["--trainer.train_batch_size", "4"]
    result = train_briefly(os.path.join(CONFIGS, f"{name}_nano.yaml"), str(tmp_path), overrides=overrides)
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        losses = [record["train/loss"] for record in map(json.loads, f) if "train/loss" in record]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert result.final_eval_loss < result.initial_eval_loss


# Greedy decoding through the engine's key/value cache, three prompts of different lengths in
# one batch, 48 new tokens each: the same tokens as transformers' generate
@pytest.mark.parametrize("name", ["gemma_mqa", "gemma2_mqa_tight_caps", "gemma3_gqa_linear_rope"])
def test_greedy_decoding_matches_transformers_generate(name, tmp_path):
    check_generation_parity(VARIANTS[name](), str(tmp_path)).assert_matches()
