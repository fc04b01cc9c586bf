"""Adam-mini against the paper's equations written out in numpy, with the blocks spelled out
by hand, and the blocks it finds in GPT-2."""

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from levanter_core.optim.config import parameter_path
from levanter_core.plugins import registry
from levanter_optim_contrib.adam_mini import MiniConfig
from levanter_optim_contrib.tests.shared import apply_steps, assert_refused, losses_of

Layers, Embed, Mlp, Vocab = hax.Axis("layers", 2), hax.Axis("embed", 6), hax.Axis("mlp", 5), hax.Axis("vocab", 7)
KvHeads, PerGroup, HeadSize = hax.Axis("kv_heads", 2), hax.Axis("q_heads_per_group", 2), hax.Axis("head_size", 3)


class Attention(eqx.Module):
    q_proj: hnn.Linear
    k_proj: hnn.Linear
    v_proj: hnn.Linear
    o_proj: hnn.Linear


class Block(eqx.Module):
    attn: Attention
    mlp: hnn.Linear
    norm: hax.NamedArray


class Model(eqx.Module):
    embed: hnn.Embedding
    first: Attention  # not stacked
    blocks: Block  # stacked: every array has a leading `layers` axis
    head: hnn.Linear
    scale: jax.Array  # a plain array


def make_model(seed=0) -> Model:
    rng = np.random.default_rng(seed)

    def normal(*axes):  # numpy, not hax.random: that compiles once per shape
        return hax.named(jnp.asarray(rng.normal(size=[a.size for a in axes]), jnp.float32), axes)

    def linear(In, Out, lead=()):
        In_, Out_ = hax.util.ensure_tuple(In), hax.util.ensure_tuple(Out)
        return hnn.Linear(normal(*lead, *Out_, *In_), normal(*lead, *Out_), In, Out)

    def attention(lead=()):
        q_out, kv_out = (KvHeads, PerGroup, HeadSize), (KvHeads, HeadSize)
        return Attention(
            linear(Embed, q_out, lead),
            linear(Embed, kv_out, lead),
            linear(Embed, kv_out, lead),
            linear(q_out, Embed, lead),
        )

    return Model(
        embed=hnn.Embedding(normal(Vocab, Embed), Vocab=Vocab, Embed=Embed),
        first=attention(),
        blocks=Block(attention((Layers,)), linear(Embed, Mlp, (Layers,)), normal(Layers, Embed)),
        head=linear(Embed, Vocab),
        scale=jnp.ones(4),
    )


# The paper's blocks for each array of Model, by hand: the positional axes that one
# second-moment value is shared over (so the blocks are the remaining indices). Weights are
# (layers?, out..., in...).
BLOCK_AXES = {
    "embed.weight": (1,),  # (vocab, embed): one per token
    "first.q_proj.weight": (2, 3),  # (kv_heads, per_group, head_size, embed): one per query head
    "first.k_proj.weight": (1, 2),  # (kv_heads, head_size, embed): one per head
    "first.v_proj.weight": (2,),  # one per output neuron
    "first.o_proj.weight": (1, 2, 3),  # (embed, kv_heads, per_group, head_size): one per output neuron
    "blocks.attn.q_proj.weight": (3, 4),  # the same with a leading layers axis: separate per layer
    "blocks.attn.k_proj.weight": (2, 3),
    "blocks.attn.v_proj.weight": (3,),
    "blocks.attn.o_proj.weight": (2, 3, 4),
    "blocks.mlp.weight": (2,),  # (layers, mlp, embed): one per output neuron
    "head.weight": (1,),  # (vocab, embed): one per token
}  # everything else (biases, norm, scale): one per parameter


def leaves_by_name(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=hax.is_named_array)
    return {parameter_path(path): np.asarray(getattr(x, "array", x), np.float64) for path, x in flat}


def adam_mini_numpy(params, grads, *, lr, beta1, beta2, eps, max_norm, wd, decayed, nesterov):
    """Adam-mini (Zhang et al. 2024, Algorithm 1) in float64 on dicts of arrays, with global
    gradient clipping and decoupled weight decay. Returns the parameters after each step."""
    p = dict(params)
    m = {k: np.zeros_like(x) for k, x in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    history = []
    for t, g in enumerate(grads, start=1):
        norm = np.sqrt(sum(np.sum(x**2) for x in g.values()))
        if max_norm and norm > max_norm:
            g = {k: x * max_norm / norm for k, x in g.items()}
        new = {}
        for k, gk in g.items():
            m[k] = beta1 * m[k] + (1 - beta1) * gk
            axes = BLOCK_AXES.get(k, ())
            block_mean = np.mean(gk**2, axis=axes, keepdims=True) if axes else gk**2
            v[k] = beta2 * v[k] + (1 - beta2) * np.broadcast_to(block_mean, gk.shape)
            if nesterov:
                m_hat = beta1 * m[k] / (1 - beta1 ** (t + 1)) + (1 - beta1) * gk / (1 - beta1**t)
            else:
                m_hat = m[k] / (1 - beta1**t)
            step = m_hat / (np.sqrt(v[k] / (1 - beta2**t)) + eps) + (wd * p[k] if decayed[k] else 0.0)
            new[k] = p[k] - lr * step
        p = new
        history.append(p)
    return history


def random_grads(params, rng, scale=1.0):
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([jnp.asarray(rng.normal(size=x.shape) * scale, jnp.float32) for x in leaves])


def run(optimizer, params, grads):
    return apply_steps(optimizer, params, grads, leaves_by_name)


def constant_lr(**fields):
    return MiniConfig(learning_rate=0.01, warmup=0, lr_schedule="constant", **fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_grad_norm": None},
        {"nesterov": True, "weight_decay": 0.1, "max_grad_norm": 1.0},
    ],
)
def test_matches_the_papers_equations_with_the_blocks_spelled_out(fields):
    params = make_model()
    config = constant_lr(beta1=0.9, beta2=0.95, **fields)
    rng = np.random.default_rng(0)
    grads = [random_grads(params, rng, s) for s in (0.05, 1.0, 0.02, 0.5)]  # norms ~0.6 to ~12

    got, _ = run(config.build(10), params, grads)
    want = adam_mini_numpy(
        leaves_by_name(params),
        [leaves_by_name(g) for g in grads],
        lr=0.01,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        max_norm=config.max_grad_norm,
        wd=config.weight_decay,
        decayed=leaves_by_name(config.build_weight_decay_mask()(params)),
        nesterov=config.nesterov,
    )
    assert set(got[0]) == set(want[0]) and set(BLOCK_AXES) < set(want[0])
    for got_step, want_step in zip(got, want):
        for name in want_step:
            np.testing.assert_allclose(got_step[name], want_step[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_second_moment_is_stored_once_per_block():
    params = make_model()
    state = constant_lr().build(10).init(params)
    flat, _ = jax.tree_util.tree_flatten_with_path(optax.tree_utils.tree_get(state, "nu"), is_leaf=hax.is_named_array)
    nu = {parameter_path(path): x for path, x in flat}
    assert nu["first.q_proj.weight"].axes == (KvHeads, PerGroup)
    assert nu["blocks.attn.k_proj.weight"].axes == (Layers, KvHeads)
    assert nu["blocks.attn.v_proj.weight"].axes == (Layers, KvHeads, HeadSize)
    assert nu["blocks.attn.o_proj.weight"].axes == (Layers, Embed)
    assert nu["embed.weight"].axes == (Vocab,) and nu["head.weight"].axes == (Vocab,)
    assert nu["blocks.norm"].axes == (Layers, Embed) and nu["scale"].shape == (4,)


def test_on_plain_arrays_it_is_adam():
    rng = np.random.default_rng(1)
    params = {"a": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.zeros(5)}
    grads = [random_grads(params, rng) for _ in range(4)]
    config = constant_lr(weight_decay=0.1, max_grad_norm=1.0)
    adamw = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=config.build_weight_decay_mask()),
    )
    for got, want in zip(run(config.build(10), params, grads)[0], run(adamw, params, grads)[0]):
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def gpt2():
    Gpt2 = registry("model").get("gpt2").config_cls
    config = Gpt2(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16)
    return config.build(hax.Axis("vocab", 64), key=jax.random.PRNGKey(0))


def test_gpt2_shares_one_value_per_head_for_queries_and_keys_and_per_neuron_elsewhere(gpt2):
    beta2 = 0.95
    opt = constant_lr(beta2=beta2, max_grad_norm=None).build(10)
    grads = random_grads(gpt2, np.random.default_rng(2))
    _, state = jax.jit(opt.update)(grads, opt.init(gpt2), gpt2)
    nu = optax.tree_utils.tree_get(state, "nu").transformer.blocks.stacked

    g = grads.transformer.blocks.stacked.attn.c_attn.weight
    g = np.asarray(g.rearrange(("layers", "qkv", "heads", "head_size", "embed")).array, np.float64)
    v = np.asarray(nu.attn.c_attn.weight.rearrange(("layers", "qkv", "heads", "head_size")).array)
    per_head = (1 - beta2) * np.mean(g[:, :2] ** 2, axis=(3, 4))  # queries and keys
    per_neuron = (1 - beta2) * np.mean(g[:, 2] ** 2, axis=3)  # values
    np.testing.assert_allclose(v[:, :2], np.broadcast_to(per_head[..., None], v[:, :2].shape), rtol=1e-5)
    np.testing.assert_allclose(v[:, 2], per_neuron, rtol=1e-5)
    assert len(np.unique(v[:, :2])) == 2 * 2 * 2  # layers x (query, key) x heads
    assert len(np.unique(v[:, 2])) == 2 * 32  # layers x (heads x head_size)

    g = np.asarray(grads.transformer.blocks.stacked.mlp.c_fc.weight.rearrange(("layers", "mlp", "embed")).array)
    v = nu.mlp.c_fc.weight.rearrange(("layers", "mlp")).array
    np.testing.assert_allclose(v, (1 - beta2) * np.mean(g.astype(np.float64) ** 2, axis=2), rtol=1e-5)

    assert nu.attn.c_proj.weight.axes == (hax.Axis("layers", 2), hax.Axis("embed", 32))
    assert optax.tree_utils.tree_get(state, "nu").embeddings.token_embeddings.weight.axes == (hax.Axis("vocab", 64),)
    assert nu.ln_1.weight.axes == gpt2.transformer.blocks.stacked.ln_1.weight.axes  # Adam


def test_loads_levanters_fields_and_defaults():
    cls = registry("optimizer").get("mini").config_cls
    assert cls is MiniConfig
    default = cls.model_validate({"type": "mini"})
    assert (default.beta1, default.beta2, default.epsilon, default.max_grad_norm) == (0.9, 0.95, 1e-8, 1.0)
    assert (default.lr, default.weight_decay, default.nesterov) == (0.02, 0.0, False)

    with pytest.warns(UserWarning, match="optimizer.lr has no effect"):
        config = cls.model_validate(
            {
                "type": "mini",
                "lr": 0.01,
                "learning_rate": 3e-3,
                "weight_decay": 0.1,
                "beta1": 0.8,
                "beta2": 0.99,
                "epsilon": 1e-6,
                "max_grad_norm": 0.5,
                "nesterov": True,
                "warmup": 0,
            }
        )
    assert (config.learning_rate, config.beta1, config.beta2, config.max_grad_norm) == (3e-3, 0.8, 0.99, 0.5)
    assert float(config.lr_scheduler(10)(0)) == pytest.approx(3e-3)  # the peak is learning_rate, not lr


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"beta2": 1.0}, r"optimizer\.beta2 .*less than 1"),
        ({"epsilon": -1e-8}, r"optimizer\.epsilon .*greater than or equal to 0"),
        ({"max_grad_norm": -1.0}, r"optimizer\.max_grad_norm .*greater than or equal to 0"),
        ({"nesterov": "sometimes"}, r"optimizer\.nesterov"),
    ],
)
def test_bad_values_name_the_field(tmp_path, fields, message):
    assert_refused(tmp_path, {"type": "mini", **fields}, message)


def test_training_the_tiny_gpt2_lowers_the_loss(gpt2):
    losses = losses_of(MiniConfig(learning_rate=1e-2, warmup=0).build_for_trainer(20), gpt2, steps=20)
    assert losses[-1] < losses[0] - 1.0, losses
