"""The shared building blocks in levanter_core.layers: masks, attention backends, rotary
scalings, norms, and the soft-capped blockwise cross-entropy."""

import dataclasses

import equinox as eqx
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
    DynamicRotaryConfig,
    LinearRotaryConfig,
    Llama3RotaryConfig,
    RmsNorm,
    YarnRotaryConfig,
    dot_product_attention,
    rotary_from_hf,
)
from levanter_core.models.cross_entropy import cross_entropy_sum, token_losses

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


def test_the_jax_backend_asks_for_cudnn_fused_attention_on_a_gpu():
    """jax.nn.dot_product_attention's default is XLA's kernel on every platform, which writes the
    whole score matrix: on the H200 it was 43% of a 1 B Llama's step. The fused kernel must be
    named; a CPU, a float32 input or a head size cuDNN does not take keep XLA's."""
    from levanter_core.layers.attention import fused_implementation

    assert fused_implementation("gpu", jnp.bfloat16, 64) == "cudnn"
    assert fused_implementation("gpu", jnp.float16, 128) == "cudnn"
    assert fused_implementation("gpu", jnp.float32, 64) is None
    assert fused_implementation("gpu", jnp.bfloat16, 12) is None
    assert fused_implementation("cpu", jnp.bfloat16, 64) is None


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's kernel needs an NVIDIA GPU")
def test_jax_backend_compiles_to_cudnn_on_a_gpu_and_matches_the_reference():
    attn = _attention(4, 2)
    Batch, Embed = Axis("batch", 2), Axis("embed", 32)
    x = hax.random.normal(jax.random.PRNGKey(1), (Batch, Pos, Embed)).astype(jnp.bfloat16)
    attn = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, attn)
    mask = AttentionMask.causal_mask()

    step = jax.jit(lambda a, x: a(x, mask))

    def with_backend(backend):
        return dataclasses.replace(attn, config=dataclasses.replace(attn.config, backend=backend))

    hlo = step.lower(with_backend("jax"), x).compile().as_text()
    assert "cudnn" in hlo.lower(), "no cuDNN call in the compiled attention"
    ours = np.asarray(step(with_backend("jax"), x).array, dtype=np.float32)
    reference = np.asarray(step(with_backend("reference"), x).array, dtype=np.float32)
    np.testing.assert_allclose(ours, reference, atol=3e-2)


@pytest.mark.parametrize(
    "mask_kind, extra",
    [("causal", {}), ("segments", {}), ("causal", {"sliding_window": 50}), ("causal", {"logits_soft_cap": 5.0})],
)
def test_causal_attention_in_query_blocks_equals_one_block(monkeypatch, mask_kind, extra):
    # 300 positions: blocks of 128, 128 and 44 queries, each over the keys up to its last query
    from levanter_core.layers import attention

    Batch, Long = Axis("batch", 2), Axis("position", 300)
    attn = _attention(4, 2, **extra)
    x = hax.random.normal(jax.random.PRNGKey(1), (Batch, Long, Axis("embed", 32)))
    mask = AttentionMask.causal_mask()
    if mask_kind == "segments":
        ids = jnp.stack([jnp.arange(300) // 70, jnp.zeros(300, jnp.int32)])
        mask = mask.with_segments(hax.named(ids, (Batch, Long)))

    def run(query_block):
        monkeypatch.setattr(attention, "QUERY_BLOCK", query_block)
        loss = lambda a, x: hax.sum(a(x, mask) ** 2).scalar()
        value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(attn, x)
        return value, jax.tree.leaves(grads)

    (blocked, blocked_grads), (whole, whole_grads) = run(128), run(10**6)
    np.testing.assert_allclose(blocked, whole, rtol=1e-5)
    for got, want in zip(blocked_grads, whole_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_attention_dropout_only_in_training_and_not_on_the_jax_backend():
    attn = _attention(4, 2)
    Batch = Axis("batch", 2)
    x = hax.random.normal(jax.random.PRNGKey(1), (Batch, Pos, Axis("embed", 32)))
    q, k, v = attn.q_proj(x), attn.k_proj(x).rename({"position": "key_position"}), attn.v_proj(x)
    v = v.rename({"position": "key_position"})
    kwargs = dict(Pos=Pos, KeyPos=KeyPos, HeadSize=attn.config.HeadSize, scale=0.35, backend="reference")
    plain = dot_product_attention(q, k, v, AttentionMask.causal_mask(), **kwargs)
    untrained = dot_product_attention(q, k, v, AttentionMask.causal_mask(), dropout=0.5, **kwargs)
    key = jax.random.PRNGKey(2)
    dropped = dot_product_attention(q, k, v, AttentionMask.causal_mask(), dropout=0.5, key=key, **kwargs)
    np.testing.assert_array_equal(untrained.array, plain.array)  # no key: inference, nothing dropped
    assert not np.allclose(dropped.array, plain.array)
    with pytest.raises(ValueError, match="cannot drop out"):
        dot_product_attention(
            q, k, v, AttentionMask.causal_mask(), dropout=0.5, key=key, **{**kwargs, "backend": "jax"}
        )


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
    assert isinstance(rotary_from_hf({"rope_type": "dynamic", "factor": 2.0}), DynamicRotaryConfig)
    with pytest.raises(ValueError, match="rope type 'proportional' is not supported"):
        rotary_from_hf({"rope_type": "proportional"})


# -- the loss -----------------------------------------------------------------------------------


def plain_cross_entropy(hidden, head, targets, weights, cap=None):
    """The loss as written down: all logits at once, differentiated by JAX."""
    logits = jnp.einsum("rpe,ev->rpv", hidden, head)
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - target) * weights)


@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("block", [None, 1, 4, 7])  # 7 does not divide the 12 positions: the last block is padded
def test_fused_cross_entropy_equals_the_plain_one_with_its_gradients(cap, block):
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    hidden = jax.random.normal(k1, (3, 12, 16))
    head = jax.random.normal(k2, (16, 37))
    targets = jax.random.randint(k3, (3, 12), 0, 37)
    weights = (jax.random.uniform(k4, (3, 12)) > 0.3).astype(jnp.float32)
    fused = jax.value_and_grad(lambda h, w: cross_entropy_sum(h, w, targets, weights, block=block, cap=cap), (0, 1))
    plain = jax.value_and_grad(lambda h, w: plain_cross_entropy(h, w, targets, weights, cap), (0, 1))
    (loss, grads), (expected, expected_grads) = jax.jit(fused)(hidden, head), plain(hidden, head)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for grad, want in zip(grads, expected_grads):
        np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-5)
    per_token = token_losses(hidden, head, targets, block=block, cap=cap)
    np.testing.assert_allclose(jnp.sum(per_token * weights), expected, rtol=1e-5)
    if cap is not None:  # the cap really changes the loss
        assert not np.isclose(plain_cross_entropy(hidden, head, targets, weights), expected)


def test_fused_cross_entropy_keeps_low_precision_gradients_in_their_dtype():
    hidden = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16)).astype(jnp.bfloat16)
    head = jax.random.normal(jax.random.PRNGKey(1), (16, 37)).astype(jnp.bfloat16)
    targets, weights = jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8))
    loss, (d_hidden, d_head) = jax.value_and_grad(
        lambda h, w: cross_entropy_sum(h, w, targets, weights, block=4), (0, 1)
    )(hidden, head)
    assert loss.dtype == jnp.float32 and d_hidden.dtype == d_head.dtype == jnp.bfloat16
    expected = plain_cross_entropy(hidden.astype(jnp.float32), head.astype(jnp.float32), targets, weights)
    np.testing.assert_allclose(loss, expected, rtol=2e-2)


def test_fused_cross_entropy_never_holds_the_full_logits():
    # XLA's own accounting of the compiled loss-and-gradient: the full [rows, position,
    # vocab] logits (131 MB here) must not fit in what a blocked loss allocates.
    rows, positions, embed, vocab = 4, 256, 64, 32000
    hidden = jax.random.normal(jax.random.PRNGKey(0), (rows, positions, embed))
    head = jax.random.normal(jax.random.PRNGKey(1), (embed, vocab))
    targets = jax.random.randint(jax.random.PRNGKey(2), (rows, positions), 0, vocab)
    weights = jnp.ones((rows, positions))
    logits_bytes = rows * positions * vocab * 4

    def temp_bytes(block):
        loss = lambda h, w: cross_entropy_sum(h, w, targets, weights, block=block)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, head).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(None) >= logits_bytes
    assert temp_bytes(16) < logits_bytes / 4
