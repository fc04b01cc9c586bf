"""The architecture kit's pieces against direct computations: attention sinks, partial rotation,
mixture-of-experts routing and dispatch, fused layouts, layer groups, norm placements, and the
declared Hugging Face mapping."""

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from haliax import Axis

from levanter_core.hf.convert import from_hf_state_dict, to_hf_state_dict
from levanter_core.hf.layouts import fuse, unfuse
from levanter_core.hf.mapping import HfKey
from levanter_core.layers import (
    Attention,
    AttentionConfig,
    AttentionMask,
    DefaultRotaryConfig,
    MoeBlock,
    MoeConfig,
    apply_rotary,
    rotary_tables,
)
from levanter_core.models.decoder import DecoderConfig

Embed = Axis("embed", 16)
Pos = Axis("position", 10)
Batch = Axis("batch", 2)


def _x(key=0):
    return hax.random.normal(jax.random.PRNGKey(key), (Batch, Pos, Embed))


def _built(config, Vocab):
    """``config.build(Vocab)``'s model with every weight drawn here at random: its structure and
    shapes are the build's, but nothing of its initializers is compiled (tens of CPU-seconds for a
    mixed stack, which these tests of layouts and forward passes do not need)."""
    rng = np.random.default_rng(0)

    def draw(leaf):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return jnp.asarray(np.zeros(leaf.shape, leaf.dtype))
        return jnp.asarray(rng.normal(scale=0.5, size=leaf.shape).astype(leaf.dtype))

    return jax.tree.map(draw, jax.eval_shape(lambda: config.build(Vocab, key=jax.random.PRNGKey(0))))


def test_attention_sinks_join_every_softmax():
    config = AttentionConfig(Embed=Embed, num_heads=4, num_kv_heads=2, head_dim=4, sinks=True)
    attn = Attention.init(config, key=jax.random.PRNGKey(0))
    x = _x()
    ours = attn(x, AttentionMask.causal_mask()).rearrange((Batch, Pos, Embed)).array

    # directly: per head, softmax over [scores of keys <= q, the head's sink], the sink's weight dropped
    q, k, v = attn.project(x)
    q = q.rearrange((Batch, "kv_heads", "q_heads_per_group", Pos, "head_size")).array.reshape(2, 4, 10, 4)
    k = jnp.repeat(k.rearrange((Batch, "kv_heads", Pos, "head_size")).array, 2, axis=1)
    v = jnp.repeat(v.rearrange((Batch, "kv_heads", Pos, "head_size")).array, 2, axis=1)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / 2.0
    scores = jnp.where(jnp.tril(jnp.ones((10, 10), bool)), scores, -jnp.inf)
    sinks = jnp.broadcast_to(attn.sinks.array[None, :, None, None], (2, 4, 10, 1))
    weights = jax.nn.softmax(jnp.concatenate([scores, sinks], -1), -1)[..., :-1]
    attended = jnp.einsum("bhqk,bhkd->bqhd", weights, v).reshape(2, 10, 16)
    direct = jnp.einsum("bqi,oi->bqo", attended, attn.o_proj.weight.rearrange((Embed, ...)).array.reshape(16, 16))
    np.testing.assert_allclose(ours, direct, atol=1e-5)
    # a sink takes weight away: without it the output differs
    plain = eqx_replace(attn, sinks=None)(x, AttentionMask.causal_mask()).rearrange((Batch, Pos, Embed)).array
    assert np.abs(plain - ours).max() > 1e-3


def eqx_replace(module, **changes):
    fields = lambda m: [getattr(m, n) for n in changes]
    return eqx.tree_at(fields, module, list(changes.values()), is_leaf=lambda x: x is None)


def test_partial_rotation_rotates_the_first_part_and_passes_the_rest():
    HeadSize = Axis("head_size", 8)
    x = hax.random.normal(jax.random.PRNGKey(1), (Pos, HeadSize))
    rope = DefaultRotaryConfig(partial_rotary_factor=0.5)
    cos, sin = rotary_tables(rope, 8, hax.arange(Pos), HeadSize)
    assert cos.resolve_axis("head_size").size == 4
    out = apply_rotary(x, cos, sin, HeadSize)
    np.testing.assert_array_equal(out[HeadSize, 4:].array, x[HeadSize, 4:].array)
    full, full_sin = rotary_tables(DefaultRotaryConfig(), 4, hax.arange(Pos), HeadSize.resize(4))
    expected = apply_rotary(x[HeadSize, :4], full, full_sin, HeadSize.resize(4))
    np.testing.assert_allclose(out[HeadSize, :4].array, expected.array, atol=1e-6)


def _route_directly(logits: np.ndarray, c: MoeConfig, correction: np.ndarray | None):
    """The chosen experts (as sets) and their weights, one token at a time."""
    chosen, weights = [], []
    for row in logits:
        if c.routing == "softmax_topk":
            p = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
            top = np.argsort(-p)[: c.top_k]
            w = p[top] / (p[top].sum() if c.normalize_top_k else 1.0)
        elif c.routing == "topk_softmax":
            top = np.argsort(-row)[: c.top_k]
            w = np.exp(row[top] - row[top].max()) / np.exp(row[top] - row[top].max()).sum()
        else:
            s = 1 / (1 + np.exp(-row))
            choice = s + correction
            groups = choice.reshape(c.num_groups, -1)
            group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
            keep = np.argsort(-group_score)[: c.top_groups]
            masked = np.full_like(choice, -np.inf).reshape(c.num_groups, -1)
            masked[keep] = groups[keep]
            top = np.argsort(-masked.reshape(-1))[: c.top_k]
            w = s[top] / (s[top].sum() + 1e-20 if c.normalize_top_k else 1.0) * c.routed_scaling
        order = np.argsort(top)
        chosen.append(top[order])
        weights.append(w[order])
    return np.array(chosen), np.array(weights)


@pytest.mark.parametrize(
    "routing",
    [
        dict(routing="softmax_topk"),
        dict(routing="softmax_topk", normalize_top_k=False),
        dict(routing="topk_softmax", router_bias=True),
        dict(routing="sigmoid_topk", correction_bias=True, num_groups=4, top_groups=2, routed_scaling=2.5),
    ],
)
def test_routing_and_dropless_dispatch_match_a_token_by_token_computation(routing):
    c = MoeConfig(Embed=Embed, num_experts=8, top_k=2, intermediate_dim=6, **routing)
    block = MoeBlock.init(c, key=jax.random.PRNGKey(2))
    if c.correction_bias:
        bias = hax.random.normal(jax.random.PRNGKey(3), c.Experts) * 0.3
        block = dataclasses.replace(block, router=dataclasses.replace(block.router, e_score_correction_bias=bias))
    x = _x(4)
    out, stats = block(x)

    tokens = x.rearrange((Batch, Pos, Embed)).array.reshape(-1, 16)
    logits = block.router.logits(hax.named(tokens, ("token", "embed"))).rearrange(("token", "experts")).array
    correction = None if not c.correction_bias else np.asarray(block.router.e_score_correction_bias.array)
    chosen, weights = _route_directly(np.asarray(logits), c, correction)
    # token by token in NumPy (JAX, op by op, would compile each token's and expert's slice alone)
    tokens = np.asarray(tokens)
    experts = block.experts
    gate_proj, up_proj = (
        np.asarray(p.rearrange(("experts", "embed", "mlp")).array) for p in (experts.gate_proj, experts.up_proj)
    )
    down_proj = np.asarray(experts.down_proj.rearrange(("experts", "mlp", "embed")).array)
    direct = np.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for e, w in zip(chosen[t], weights[t]):
            gate, up = tokens[t] @ gate_proj[e], tokens[t] @ up_proj[e]
            direct[t] += w * (gate / (1 + np.exp(-gate)) * up) @ down_proj[e]  # silu(gate) * up
    np.testing.assert_allclose(out.rearrange((Batch, Pos, Embed)).array.reshape(-1, 16), direct, atol=1e-5)
    assert float(hax.sum(stats.expert_fraction).scalar()) == pytest.approx(2.0)


def test_fuse_and_unfuse_are_inverse_with_leading_axes():
    rng = np.random.default_rng(0)
    state = {f"a.{p}.weight": rng.normal(size=(3, n, 5)) for p, n in (("q", 4), ("k", 2), ("v", 2))}
    state.update({f"a.{p}.bias": rng.normal(size=(3, n)) for p, n in (("q", 4), ("k", 2), ("v", 2))})
    fused = fuse(state, "a", ("q", "k", "v"), "qkv")
    assert set(fused) == {"a.qkv.weight", "a.qkv.bias"} and fused["a.qkv.weight"].shape == (3, 8, 5)
    back = unfuse(fused, "a", (("q", 4), ("k", 2), ("v", 2)), "qkv")
    assert set(back) == set(state) and all(np.array_equal(back[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="a.qkv.weight has 8 output rows; expected 9"):
        unfuse(fused, "a", (("q", 5), ("k", 2), ("v", 2)), "qkv")


class _Mixed(DecoderConfig):
    type: str = "kit_test_mixed"
    hf_model_type = "test"
    hf_architecture = "Test"

    def moe_config(self):
        return MoeConfig(Embed=self.Embed, num_experts=4, top_k=2, intermediate_dim=8, shared_intermediate_dim=8)

    def layer_kinds(self):
        return ("dense", "dense", "moe", "moe", "dense")[: self.num_layers]


@pytest.mark.parametrize("scan", [True, False])
def test_layer_groups_number_layers_as_one_sequence(scan):
    config = _Mixed(seq_len=10, hidden_dim=16, intermediate_dim=32, num_layers=5, num_heads=2, num_kv_heads=1,
                    scan_layers=scan)  # fmt: skip
    Vocab = Axis("vocab", 20)
    model = _built(config, Vocab)
    state = to_hf_state_dict(model)
    layer_of = {name.split(".")[2] for name in state if name.startswith("model.layers.")}
    assert layer_of == {"0", "1", "2", "3", "4"}
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in state and "model.layers.4.mlp.gate_proj.weight" in state
    assert "model.layers.3.mlp.shared_experts.up_proj.weight" in state
    loaded = from_hf_state_dict(jax.eval_shape(lambda: config.build(Vocab, key=jax.random.PRNGKey(1))), state)
    ids = hax.named(jnp.arange(20).reshape(2, 10), ("batch", "position"))
    # one compiled forward for both models (op by op, each of the model's operations compiles alone)
    forward = eqx.filter_jit(lambda m: m(ids).array)
    np.testing.assert_array_equal(forward(loaded), forward(model))
    aux = eqx.filter_eval_shape(lambda m: m.activations_with_aux(ids)[1], model)
    assert aux.metrics["moe/load_balancing_loss"].shape == ()  # pooled over the two moe layers


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich"])
def test_norm_placements(placement):
    class Placed(DecoderConfig):
        type: str = "kit_test_norms"
        norm_placement = placement

    config = Placed(hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2, num_kv_heads=2, seq_len=10)
    layer = _built(config, Axis("vocab", 20)).model.layers.unstacked()[0]
    x, mask = _x(5), AttentionMask.causal_mask()
    ln = {n: getattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm",
                                           "pre_feedforward_layernorm", "post_feedforward_layernorm")}  # fmt: skip
    if placement == "pre":
        h = x + layer.self_attn(ln["input_layernorm"](x), mask)
        expected = h + layer.mlp(ln["post_attention_layernorm"](h))
    elif placement == "post":
        h = x + ln["post_attention_layernorm"](layer.self_attn(x, mask))
        expected = h + ln["post_feedforward_layernorm"](layer.mlp(h))
    else:
        h = x + ln["post_attention_layernorm"](layer.self_attn(ln["input_layernorm"](x), mask))
        expected = h + ln["post_feedforward_layernorm"](layer.mlp(ln["pre_feedforward_layernorm"](h)))
    present = {n for n, v in ln.items() if v is not None}
    assert present == {"pre": {"input_layernorm", "post_attention_layernorm"},
                       "post": {"post_attention_layernorm", "post_feedforward_layernorm"},
                       "sandwich": set(ln)}[placement]  # fmt: skip
    np.testing.assert_allclose(layer(x, mask).array, expected.array, atol=1e-6)


def test_declared_mapping_refuses_by_name_and_requires_keys():
    class Mapped(DecoderConfig):
        type: str = "kit_test_mapped"
        hf_model_type = "mapped"
        hf_refused = {"mlp_bias": (False, None)}

    hf = {"max_position_embeddings": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 2}  # fmt: skip
    config = Mapped.from_hf_config(hf)
    assert (config.num_kv_heads, config.head_dim, config.layer_norm_epsilon) == (2, None, 1e-6)
    assert Mapped.from_hf_config(config.to_hf_config(50)) == config
    with pytest.raises(ValueError, match=r"mlp_bias: true is not supported \(a Mapped needs false or null\)"):
        Mapped.from_hf_config({**hf, "mlp_bias": True})
    with pytest.raises(ValueError, match="config.json has no 'hidden_size', which gives the model's hidden_dim"):
        Mapped.from_hf_config({k: v for k, v in hf.items() if k != "hidden_size"})
    assert HfKey("x", 3).value_in({}, "f") == 3


def test_a_field_redeclared_for_its_default_keeps_its_docstring():
    class Wider(DecoderConfig):
        type: str = "kit_test_wider"
        hidden_dim: int = 8192

    assert Wider().hidden_dim == 8192
    assert Wider.model_fields["hidden_dim"].description == DecoderConfig.model_fields["hidden_dim"].description


def test_the_default_weight_decay_mask_decays_expert_and_router_matrices_only():
    from levanter_core.optim.adam import AdamConfig

    c = MoeConfig(Embed=Embed, num_experts=4, top_k=2, intermediate_dim=6, correction_bias=True, expert_bias=True)
    block = MoeBlock.init(c, key=jax.random.PRNGKey(0))
    mask = AdamConfig().build_weight_decay_mask()(block)
    assert mask.experts.gate_proj and mask.experts.up_proj and mask.experts.down_proj and mask.router.weight
    assert not mask.router.e_score_correction_bias and not mask.experts.gate_bias and not mask.experts.down_bias


@pytest.mark.parametrize("kind", ["attention", "latent"])
def test_attention_steps_compose_as_a_key_value_cache_would(kind):
    """Decoding one token: project the prefix once (what a cache keeps), project the new token at
    its own position, attend with the cached keys: the same output as the whole sequence's."""
    from levanter_core.layers.mla import MlaConfig, MultiHeadLatentAttention

    rope = DefaultRotaryConfig(theta=100.0)
    if kind == "attention":
        attn = Attention.init(
            AttentionConfig(Embed=Embed, num_heads=4, num_kv_heads=2, head_dim=4, rope=rope, qk_norm="head"),
            key=jax.random.PRNGKey(0),
        )
    else:
        config = MlaConfig(Embed=Embed, num_heads=2, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4,
                           v_head_dim=3, q_lora_rank=5, rope=rope)  # fmt: skip
        attn = MultiHeadLatentAttention.init(config, key=jax.random.PRNGKey(0))
    last = Pos.size - 1

    @eqx.filter_jit  # one compiled program (op by op, each operation would compile on its own)
    def full_and_step(attn, x):
        full = attn(x, AttentionMask.causal_mask())
        _, k_prefix, v_prefix = attn.project(x["position", :last])
        Step = Axis("position", 1)
        q, k_new, v_new = attn.project(
            x["position", last:], positions=hax.named(jnp.array([last]), Step), seq_len=Pos.size
        )
        to_keys = {"position": "key_position"}
        k = hax.concatenate("key_position", [k_prefix.rename(to_keys), k_new.rename(to_keys)])
        v = hax.concatenate("key_position", [v_prefix.rename(to_keys), v_new.rename(to_keys)])
        # the one new query may see every cached key
        step = attn.o_proj(attn.attend(q, k, v, AttentionMask(causal=False)))
        return full["position", last].array, step["position", 0].array

    full, step = full_and_step(attn, _x(6))
    np.testing.assert_allclose(step, full, atol=1e-5)


def test_a_family_with_a_plain_mlp():
    """The feed-forward block is a choice: a family returning the core's plain two-layer ``Mlp``
    gets ``up_proj`` / ``down_proj`` (no gate) in its layers and its checkpoints."""
    from levanter_core.layers import Mlp

    class Plain(DecoderConfig):
        type: str = "kit_test_plain_mlp"

        def mlp_module(self, *, key):
            return Mlp.init(self.Embed, self.Mlp, "gelu", key=key, std=self.initializer_range)

    config = Plain(hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2, num_kv_heads=2, seq_len=10)
    model = _built(config, Axis("vocab", 20))
    state = to_hf_state_dict(model)
    assert "model.layers.1.mlp.up_proj.weight" in state and not any("gate_proj" in k for k in state)
    ids = hax.named(jnp.arange(20).reshape(2, 10), ("batch", "position"))
    layer = model.model.layers.unstacked()[0]
    x = model.model.embed_tokens.embed(ids)
    h = x + layer.self_attn(layer.input_layernorm(x), AttentionMask.causal_mask())
    hidden = layer.post_attention_layernorm(h)
    expected = h + layer.mlp.down_proj(hax.nn.gelu(layer.mlp.up_proj(hidden), approximate=False))
    np.testing.assert_allclose(layer(x, AttentionMask.causal_mask()).array, expected.array, atol=1e-5)
