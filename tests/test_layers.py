"""The shared building blocks in levanter_core.layers: masks, attention backends, rotary
scalings, norms, and the soft-capped blockwise cross-entropy."""

import dataclasses

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from haliax import Axis

from levanter_core.layers import (
    Attention,
    AttentionConfig,
    AttentionMask,
    DefaultRotaryConfig,
    LinearRotaryConfig,
    Llama3RotaryConfig,
    RmsNorm,
    YarnRotaryConfig,
    rotary_from_hf,
)
from levanter_core.models.lm import _cross_entropy

Pos = Axis("position", 8)
KeyPos = Pos.alias("key_position")


def allowed(mask: AttentionMask, **kwargs) -> np.ndarray:
    return np.asarray(mask.materialize(Pos, KeyPos, **kwargs).rearrange((..., "position", "key_position")).array)


def test_causal_mask_sees_the_past_and_itself():
    np.testing.assert_array_equal(allowed(AttentionMask.causal_mask()), np.tril(np.ones((8, 8), bool)))


def test_sliding_window_holds_window_keys_including_the_query():
    m = allowed(AttentionMask.causal_mask(), window=3)
    assert m[5].nonzero()[0].tolist() == [3, 4, 5]
    assert m[0].nonzero()[0].tolist() == [0]
    # a traced per-layer switch: off means the full causal mask
    off = allowed(AttentionMask.causal_mask(), window=3, sliding=jnp.asarray(False))
    np.testing.assert_array_equal(off, np.tril(np.ones((8, 8), bool)))


def test_segments_do_not_attend_across_documents():
    Batch = Axis("batch", 2)
    segments = hax.named(jnp.array([[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8]), (Batch, Pos))
    m = allowed(AttentionMask.causal_mask().with_segments(segments))
    assert m.shape == (2, 8, 8)
    assert m[0, 4].nonzero()[0].tolist() == [3, 4]
    assert m[0, 7].nonzero()[0].tolist() == [5, 6, 7]
    np.testing.assert_array_equal(m[1], np.tril(np.ones((8, 8), bool)))


def _attention(num_heads, num_kv_heads, **extra):
    config = AttentionConfig(
        Embed=Axis("embed", 32), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=8,
        rope=DefaultRotaryConfig(), backend="reference", **extra,
    )  # fmt: skip
    return Attention.init(config, key=jax.random.PRNGKey(0))


@pytest.mark.parametrize(
    "heads, kv_heads, extra, mask_kind",
    [
        (4, 4, {}, "causal"),  # multi-head
        (4, 2, {}, "causal"),  # grouped-query
        (4, 1, {}, "segments"),  # multi-query
        (4, 2, {"sliding_window": 3}, "causal"),
        (4, 2, {"sliding_window": 3}, "traced"),
        (4, 2, {"qk_norm": "head"}, "causal"),
        (4, 2, {"qk_norm": "all_heads", "qkv_bias": True}, "causal"),
    ],
)
def test_jax_backend_matches_the_reference(heads, kv_heads, extra, mask_kind):
    attn = _attention(heads, kv_heads, **extra)
    Batch = Axis("batch", 2)
    x = hax.random.normal(jax.random.PRNGKey(1), (Batch, Pos, Axis("embed", 32)))
    mask = AttentionMask.causal_mask()
    if mask_kind == "segments":
        mask = mask.with_segments(hax.named(jnp.array([[0] * 4 + [1] * 4, [0] * 8]), (Batch, Pos)))
    sliding = jnp.asarray(True) if mask_kind == "traced" else None

    def run(backend):
        a = dataclasses.replace(attn, config=dataclasses.replace(attn.config, backend=backend))
        return np.asarray(jax.jit(lambda a, x: a(x, mask, sliding=sliding))(a, x).array)

    np.testing.assert_allclose(run("jax"), run("reference"), atol=1e-5)


def test_all_heads_norm_exports_flat_weights():
    from haliax.state_dict import flatten_modules_for_export, to_state_dict

    attn = _attention(4, 2, qk_norm="all_heads")
    names = {k: v.shape for k, v in to_state_dict(flatten_modules_for_export(attn)).items()}
    assert names["q_norm.weight"] == (32,) and names["k_norm.weight"] == (16,)
    assert names["q_proj.weight"] == (32, 32) and names["k_proj.weight"] == (16, 32)


def test_gemma_style_norm_scales_by_one_plus_weight():
    Embed = Axis("embed", 4)
    norm = RmsNorm.init(Embed, eps=0.0, weight_offset=1.0)
    x = hax.named(jnp.array([1.0, -1.0, 1.0, -1.0]), Embed)
    np.testing.assert_allclose(norm(x).array, x.array)  # stored weight 0 -> scale exactly 1


# -- rotary scalings against transformers' own functions ------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 16.0, "mscale": 0.707, "mscale_all_dim": 1.0},
    ],
)  # fmt: skip
def test_rotary_frequencies_match_transformers(params):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=256, rope_parameters=dict(params)
    )
    ours = rotary_from_hf(dict(params))
    if params["rope_type"] == "default":
        expected = 1.0 / (params["rope_theta"] ** (np.arange(0, 64, 2) / 64))
        scale = 1.0
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
        expected = inv_freq.numpy()
    np.testing.assert_allclose(ours.inverse_frequencies(64), expected, rtol=1e-6)
    assert ours.table_scale() == pytest.approx(scale)
    assert rotary_from_hf(ours.to_hf()) == ours


def test_rotary_config_types():
    assert isinstance(rotary_from_hf(None), DefaultRotaryConfig)
    assert isinstance(rotary_from_hf({"type": "linear", "factor": 2.0}), LinearRotaryConfig)  # legacy key
    assert isinstance(rotary_from_hf({"rope_type": "llama3", "factor": 8.0}), Llama3RotaryConfig)
    assert isinstance(rotary_from_hf({"rope_type": "yarn", "factor": 2.0}), YarnRotaryConfig)
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        rotary_from_hf({"rope_type": "dynamic", "factor": 2.0})


# -- the loss -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [None, 3.0])
def test_blockwise_cross_entropy_equals_the_full_one(cap):
    Embed, Vocab, Batch = Axis("embed", 16), Axis("vocab", 37), Axis("batch", 3)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    hidden = hax.random.normal(k1, (Batch, Pos, Embed))
    head = hax.random.normal(k2, (Embed, Vocab))
    targets = hax.random.randint(k3, (Batch, Pos), 0, Vocab.size)
    full = _cross_entropy(hidden, head, targets, Vocab, None, cap)
    blocked = _cross_entropy(hidden, head, targets, Vocab, 8, cap)
    np.testing.assert_allclose(blocked.rearrange(full.axes).array, full.array, rtol=1e-5)
    if cap is not None:  # the cap really changes the loss
        uncapped = _cross_entropy(hidden, head, targets, Vocab, None, None)
        assert not np.allclose(uncapped.array, full.array)


def test_blockwise_cross_entropy_never_holds_the_full_logits():
    # XLA's own accounting of the compiled loss-and-gradient: the full [batch, position,
    # vocab] logits (131 MB here) must not fit in what the blockwise version allocates.
    Embed, Vocab, Batch, Positions = Axis("embed", 64), Axis("vocab", 32000), Axis("batch", 4), Axis("position", 256)
    hidden = hax.random.normal(jax.random.PRNGKey(0), (Batch, Positions, Embed))
    head = hax.random.normal(jax.random.PRNGKey(1), (Embed, Vocab))
    targets = hax.random.randint(jax.random.PRNGKey(2), (Batch, Positions), 0, Vocab.size)
    logits_bytes = Batch.size * Positions.size * Vocab.size * 4

    def temp_bytes(block):
        loss = lambda h, w: hax.sum(_cross_entropy(h, w, targets, Vocab, block)).scalar()  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, head).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(None) > logits_bytes
    assert temp_bytes(2048) < logits_bytes / 2
