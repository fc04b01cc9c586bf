"""Muon (``type: muon``) and the Newton-Schulz orthogonalization it shares with Scion."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from optax.contrib._muon import orthogonalize_via_newton_schulz
from pydantic import ValidationError

from levanter_core.layers.moe import MoeBlock, MoeConfig
from levanter_core.plugins import registry
from levanter_optim_contrib.orthogonalize import (
    NS_COEFFICIENTS,
    label_matrices,
    map_matrices,
    newton_schulz,
    shape_scale,
)
from levanter_optim_contrib.tests.shared import losses_of, newton_schulz_reference

LEVANTER_CONFIGS = Path(__file__).resolve().parents[5] / "shared" / "levanter-configs" / "config"

Embed, Heads, HeadSize = hax.Axis("embed", 6), hax.Axis("heads", 2), hax.Axis("head_size", 5)
Vocab = hax.Axis("vocab", 9)


def muon_config(**fields):
    return registry("optimizer").get("muon").config_cls.model_validate(fields)


class Tiny(eqx.Module):
    """Two hidden linear layers with several output (``qkv``) or input (``proj``) axes, stored
    input-first and output-first, and what Muon leaves to AdamW: an embedding, an LM head (a
    linear layer), biases and a norm's scale."""

    embedding: hnn.Embedding
    qkv: hnn.Linear  # embed -> (heads, head_size): 10 x 6, stored (embed, heads, head_size)
    proj: hnn.Linear  # (heads, head_size) -> embed: 6 x 10, with a bias
    lm_head: hnn.Linear  # embed -> vocab
    norm: hax.NamedArray


def tiny(key) -> Tiny:
    k = jax.random.split(key, 5)
    return Tiny(
        hnn.Embedding(hax.random.normal(k[0], (Vocab, Embed)), Vocab=Vocab, Embed=Embed),
        hnn.Linear(
            weight=hax.random.normal(k[1], (Embed, Heads, HeadSize)), bias=None, In=Embed, Out=(Heads, HeadSize)
        ),
        hnn.Linear(
            weight=hax.random.normal(k[2], (Embed, Heads, HeadSize)),
            bias=hax.random.normal(k[3], (Embed,)),
            In=(Heads, HeadSize),
            Out=Embed,
        ),
        hnn.Linear(weight=hax.random.normal(k[4], (Vocab, Embed)), bias=None, In=Embed, Out=Vocab),
        hax.ones(Embed),
    )


@eqx.filter_jit
def random_like(tree, key):
    leaves, structure = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(structure, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def as_plain(t: Tiny) -> dict:
    """The same parameters as plain arrays, each linear weight as one ``(in, out)`` matrix (the
    layout of optax's default ``MuonDimensionNumbers``)."""
    return {
        "embedding": t.embedding.weight.array,
        "qkv": t.qkv.weight.rearrange(("embed", "heads", "head_size")).array.reshape(6, 10),
        "proj": t.proj.weight.rearrange(("heads", "head_size", "embed")).array.reshape(10, 6),
        "proj_bias": t.proj.bias.array,
        "lm_head": t.lm_head.weight.array,
        "norm": t.norm.array,
    }


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# -- Newton-Schulz ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape, steps", [((6, 10), 5), ((10, 6), 10), ((3, 7, 5), 1), ((2, 4, 9), 5)])
def test_newton_schulz_is_the_quintic_on_singular_values(shape, steps):
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    got = np.asarray(newton_schulz(x, steps))
    batch = np.asarray(x).reshape(-1, *shape[-2:])
    want = np.stack([newton_schulz_reference(m, steps) for m in batch]).reshape(shape)
    assert_close(got, want, rtol=1e-4, atol=2e-5)


def test_newton_schulz_nearly_orthogonalizes():
    # Keller Jordan's coefficients trade exact convergence for speed: after 5 steps every
    # singular value of a random matrix lies within about [0.7, 1.2] of 1, the singular vectors
    # are G's, so the result is within that spread of U V^T.
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (32, 48)))
    got = np.asarray(newton_schulz(jnp.asarray(x), 5), np.float64)
    singular = np.linalg.svd(got, compute_uv=False)
    assert singular.min() > 0.6 and singular.max() < 1.25
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    assert np.linalg.norm(got - u @ vt, 2) < 0.35


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8)])
def test_newton_schulz_matches_optax(shape):
    x = jax.random.normal(jax.random.PRNGKey(2), shape)
    ours = newton_schulz(x, 5)
    # optax's (in, out) matrix is our (out, in) one transposed; the iteration commutes with that
    theirs = orthogonalize_via_newton_schulz(x.T, jnp.asarray(NS_COEFFICIENTS), 5).T
    assert_close(ours, theirs)


def test_newton_schulz_keeps_a_zero_matrix_at_zero():
    assert not np.any(np.asarray(newton_schulz(jnp.zeros((4, 6)), 5)))


# -- finding the matrices -----------------------------------------------------------------


def test_labels_follow_levanter():
    labels = label_matrices(tiny(jax.random.PRNGKey(0)), "muon", "adamw")
    assert (labels.qkv.weight, labels.proj.weight) == ("muon", "muon")
    assert labels.lm_head.weight == "adamw"  # excluded by its name, as in Levanter
    assert (labels.embedding.weight, labels.proj.bias, labels.norm) == ("adamw", "adamw", "adamw")


def test_mixture_of_experts_matrices_are_per_expert():
    config = MoeConfig(Embed=hax.Axis("embed", 6), num_experts=3, top_k=1, intermediate_dim=4)
    block = MoeBlock.init(config, key=jax.random.PRNGKey(0))
    labels = label_matrices(block, "m", "o")
    assert labels.router.weight == "m"
    assert (labels.experts.gate_proj, labels.experts.up_proj, labels.experts.down_proj) == ("m", "m", "m")
    mapped = map_matrices(lambda x: newton_schulz(x, 5), block)
    down = block.experts.down_proj.rearrange(("experts", "mlp", "embed")).array  # (in, out) per expert
    got = mapped.experts.down_proj.rearrange(("experts", "mlp", "embed")).array
    for e in range(3):
        assert_close(got[e], newton_schulz_reference(down[e].T, 5).T, rtol=1e-4, atol=2e-5)
    assert_close(
        mapped.router.weight.array, newton_schulz_reference(block.router.weight.array, 5), rtol=1e-4, atol=2e-5
    )


@pytest.mark.parametrize("kimi", [False, True])
def test_shape_scale(kimi):
    if kimi:
        assert shape_scale(128, 32, kimi=True) == pytest.approx(0.2 * math.sqrt(128))
        assert shape_scale(32, 128, kimi=True) == pytest.approx(0.2 * math.sqrt(128))
    else:
        assert shape_scale(128, 32) == pytest.approx(2.0)
        assert shape_scale(32, 128) == pytest.approx(1.0)


# -- the optimizer ----------------------------------------------------------------------------


@pytest.mark.parametrize("kimi", [False, True])
def test_matches_optax_muon(kimi):
    """Three steps against ``optax.contrib.muon`` with the same settings. optax keeps an
    average (``(1 - beta) g`` terms, bias-corrected) where Levanter keeps a sum; without
    Nesterov the two differ by a scalar factor, which the Frobenius normalization before
    Newton-Schulz removes. optax's Nesterov look-ahead weighs the new gradient differently
    (see test_nesterov_matches_levanters_equations)."""
    lr, adam_lr, wd = 0.02, 0.003, 0.1
    config = muon_config(
        learning_rate=lr,
        adam_lr=adam_lr,
        weight_decay=wd,
        warmup=0,
        lr_schedule="constant",
        nesterov=False,
        max_grad_norm=None,
        use_kimi_scaling=kimi,
        # optax decays all of Muon's matrices and, here, none of AdamW's parameters
        default_weight_decay_mask=False,
        weight_decay_modules=r"^(qkv|proj)\.weight$",
    )
    params = tiny(jax.random.PRNGKey(0))
    dims = optax.contrib.MuonDimensionNumbers(0, 1)
    reference = optax.contrib.muon(
        learning_rate=lr,
        adam_learning_rate=adam_lr,
        ns_steps=5,
        beta=0.95,
        eps=1e-8,
        weight_decay=wd,
        nesterov=False,
        adaptive=False,
        adam_b1=0.9,
        adam_b2=0.95,
        adam_weight_decay=0.0,
        consistent_rms=0.2 if kimi else None,
        muon_weight_dimension_numbers={k: dims if k in ("qkv", "proj") else None for k in as_plain(params)},
    )
    ours = config.build_for_trainer(10)
    plain = as_plain(params)
    state, ref_state = ours.init(params), reference.init(plain)
    for step in range(3):
        grads = random_like(params, jax.random.PRNGKey(10 + step))
        updates, state = jax.jit(ours.update)(grads, state, params)
        ref_updates, ref_state = jax.jit(reference.update)(as_plain(grads), ref_state, plain)
        for name, value in as_plain(updates).items():
            assert_close(value, ref_updates[name], atol=2e-6)
        params = eqx.apply_updates(params, updates)
        plain = optax.apply_updates(plain, ref_updates)


def test_nesterov_matches_levanters_equations():
    """B <- m B + G, M = m B + G, update = -lr (scale NS(M) + wd W), in float64, over three steps."""
    lr, m, wd, steps = 0.05, 0.9, 0.2, 5
    config = muon_config(
        learning_rate=lr, momentum=m, weight_decay=wd, warmup=0, lr_schedule="constant", backend_steps=steps
    )
    opt = config.build_for_trainer(10)
    params = tiny(jax.random.PRNGKey(3))
    state = opt.init(params)
    plain = {k: np.asarray(v, np.float64) for k, v in as_plain(params).items()}
    buf = {k: np.zeros_like(plain[k]) for k in ("qkv", "proj")}
    for step in range(3):
        grads = random_like(params, jax.random.PRNGKey(20 + step))
        updates, state = jax.jit(opt.update)(grads, state, params)
        got = as_plain(updates)
        for name in ("qkv", "proj"):
            g = np.asarray(as_plain(grads)[name], np.float64)
            buf[name] = m * buf[name] + g
            look_ahead = m * buf[name] + g
            # (in, out) here; orthogonalize the (out, in) matrix, as Muon does
            d_in, d_out = look_ahead.shape
            direction = newton_schulz_reference(look_ahead.T, steps).T * math.sqrt(max(1, d_out / d_in))
            want = -lr * (direction + wd * plain[name])
            assert_close(got[name], want, rtol=1e-4, atol=2e-6)
            plain[name] = plain[name] + want
        params = eqx.apply_updates(params, updates)


def test_each_part_gets_its_learning_rate_on_the_same_schedule():
    """With the same gradients every step, Adam's bias-corrected step is ``g / (|g| + eps)``, so
    the AdamW parameters move by ``adam_lr * schedule(t) / learning_rate`` per coordinate,
    and the matrices by ``schedule(t)`` times their (fixed) orthogonalized direction."""
    lr, adam_lr, n = 0.02, 0.005, 6
    config = muon_config(learning_rate=lr, adam_lr=adam_lr, warmup=2, max_grad_norm=None, nesterov=False)
    schedule = config.lr_scheduler(n)
    opt = config.build_for_trainer(n)
    params = tiny(jax.random.PRNGKey(4))
    grads = random_like(params, jax.random.PRNGKey(5))
    g = as_plain(grads)
    state = opt.init(params)
    direction = newton_schulz_reference(g["qkv"].T, 5).T * math.sqrt(10 / 6)
    for step in range(n):
        updates, state = jax.jit(opt.update)(grads, state, params)
        got = as_plain(updates)
        ratio = float(schedule(step)) / lr
        for name in ("embedding", "lm_head", "proj_bias", "norm"):
            assert_close(got[name], -adam_lr * ratio * g[name] / (np.abs(g[name]) + 1e-8), atol=1e-7)
        assert_close(got["qkv"], -lr * ratio * direction, rtol=1e-4, atol=1e-7)
    assert float(schedule(1)) == pytest.approx(lr / 2)  # the warmup was seen


def test_kimi_scaling_factors():
    grads = random_like(tiny(jax.random.PRNGKey(6)), jax.random.PRNGKey(7))

    def first_update(kimi):
        opt = muon_config(learning_rate=1.0, warmup=0, lr_schedule="constant", use_kimi_scaling=kimi).build(10)
        params = tiny(jax.random.PRNGKey(6))
        return as_plain(opt.update(grads, opt.init(params), params)[0])

    plain, kimi = first_update(False), first_update(True)
    # qkv is 10 x 6 (out x in), proj 6 x 10
    assert_close(kimi["qkv"], plain["qkv"] * (0.2 * math.sqrt(10)) / math.sqrt(10 / 6), rtol=1e-5)
    assert_close(kimi["proj"], plain["proj"] * 0.2 * math.sqrt(10), rtol=1e-5)
    assert_close(kimi["embedding"], plain["embedding"])  # AdamW's part does not change


# -- models: stacked layers, training -----------------------------------------------------------

Gpt2 = registry("model").get("gpt2").config_cls


def gpt2(**fields):
    config = Gpt2(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16, **fields)
    # one compiled program rather than hundreds of small eager ones
    return eqx.filter_jit(lambda: config.build(Vocab, key=jax.random.PRNGKey(0)))()


def stacked_like(unrolled, template):
    """``unrolled`` (a tree of the unrolled model's structure) in ``template``'s (the stacked
    model's), each block's arrays stacked along ``layers``."""
    blocks = unrolled.transformer.blocks.blocks
    stacked = jax.tree.map(lambda *xs: hax.stack("layers", xs), *blocks, is_leaf=hax.is_named_array)
    rest = (unrolled.transformer.ln_f, unrolled.embeddings)
    return jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves((stacked, rest)))


def test_stacked_layers_are_orthogonalized_per_layer():
    """A scanned model (blocks stacked along ``layers``) and the same model unrolled get the same
    updates from the same gradients: each layer's matrix is orthogonalized on its own."""
    unrolled, stacked = gpt2(scan_layers=False), gpt2()
    for a, b in zip(jax.tree.leaves(stacked_like(unrolled, stacked)), jax.tree.leaves(stacked)):
        assert a.shape == b.shape and bool(jnp.all(a == b))
    opt = muon_config(learning_rate=0.02, adam_lr=0.001, weight_decay=0.1, warmup=0).build_for_trainer(10)
    s_unrolled, s_stacked = opt.init(unrolled), opt.init(stacked)
    update = eqx.filter_jit(opt.update)
    for step in range(2):
        g = random_like(eqx.filter(unrolled, eqx.is_array), jax.random.PRNGKey(30 + step))
        u_unrolled, s_unrolled = update(g, s_unrolled, unrolled)
        g_stacked = stacked_like(g, eqx.filter(stacked, eqx.is_array))
        u_stacked, s_stacked = update(g_stacked, s_stacked, stacked)
        want = stacked_like(u_unrolled, u_stacked)
        for a, b in zip(jax.tree.leaves(u_stacked), jax.tree.leaves(want)):
            assert_close(a, b, atol=1e-7)
        unrolled, stacked = eqx.apply_updates(unrolled, u_unrolled), eqx.apply_updates(stacked, u_stacked)
    # and the matrices did go through Muon: an orthogonalized update has all its singular values near lr
    c_fc = u_stacked.transformer.blocks.stacked.mlp.c_fc.weight.rearrange(("layers", "mlp", "embed")).array
    singular = np.linalg.svd(np.asarray(c_fc, np.float64), compute_uv=False) / (0.02 * 2)  # scale sqrt(128/32)
    assert singular.min() > 0.5 and singular.max() < 1.3


def test_training_lowers_the_loss():
    opt = muon_config(learning_rate=0.02, adam_lr=0.003, warmup=0).build_for_trainer(20)
    losses = losses_of(opt, gpt2(), steps=15, vocab=Vocab.size)
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.5, losses


# -- the config ---------------------------------------------------------------------------------


def test_levanter_field_names_and_defaults():
    with pytest.warns(UserWarning, match="no effect"):  # lr, Levanter's leftover
        config = muon_config(
            learning_rate=0.01,
            lr=0.02,
            adam_lr=6e-4,
            momentum=0.95,
            nesterov=True,
            backend_steps=5,
            weight_decay=0.0,
            beta1=0.9,
            beta2=0.95,
            epsilon=1e-8,
            muon_epsilon=1e-8,
            max_grad_norm=1.0,
            use_kimi_scaling=False,
        )
    defaults = muon_config()
    for name in ("adam_lr", "momentum", "nesterov", "backend_steps", "weight_decay", "beta1", "beta2", "epsilon"):
        assert getattr(config, name) == getattr(defaults, name)
    assert (defaults.learning_rate, defaults.weight_decay, defaults.max_grad_norm) == (6e-4, 0.0, 1.0)


def test_levanters_yaml_loads():
    path = LEVANTER_CONFIGS / "gpt2_small_fast_muon.yaml"
    if not path.exists():
        pytest.skip(f"{path} (Levanter's configs) is not here")
    from levanter_core.config.train import load_train_config

    config, _ = load_train_config(str(path))
    assert type(config.optimizer).__name__ == "MuonConfig"
    assert (config.optimizer.learning_rate, config.optimizer.weight_decay) == (1e-2, 0.05)
    assert config.optimizer.adam_lr == 6e-4


def test_unused_lr_warns():
    with pytest.warns(UserWarning, match="optimizer.lr .* no effect"):
        muon_config(lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        muon_config(learning_rate=0.1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("momentum", 1.0),
        ("backend_steps", 0),
        ("adam_lr", -1.0),
        ("muon_epsilon", 0.0),
        ("max_grad_norm", 0.0),
        ("beta2", 1.5),
    ],
)
def test_bad_values_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        muon_config(**{field: value})


def test_unknown_field_is_refused():
    with pytest.raises(ValidationError, match="adam_learning_rate"):
        muon_config(adam_learning_rate=1e-3)
