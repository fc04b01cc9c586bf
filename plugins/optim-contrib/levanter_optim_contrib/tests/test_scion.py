"""Scion (``type: scion``) against the paper's equations (Pethick et al. 2025), in float64."""

from __future__ import annotations

import math

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import numpy as np
import pytest
from pydantic import ValidationError

from levanter_core.plugins import registry
from levanter_optim_contrib.tests.shared import losses_of, newton_schulz_reference

Embed, Mlp, Vocab = hax.Axis("embed", 6), hax.Axis("mlp", 10), hax.Axis("vocab", 9)


def scion_config(**fields):
    return registry("optimizer").get("scion").config_cls.model_validate(fields)


class Tiny(eqx.Module):
    embedding: hnn.Embedding
    up: hnn.Linear  # embed -> mlp, with a bias
    down: hnn.Linear  # mlp -> embed, stored input-first
    lm_head: hnn.Linear  # embed -> vocab: sign steps, as in Levanter
    norm: hax.NamedArray


def tiny(key) -> Tiny:
    k = jax.random.split(key, 5)
    return Tiny(
        hnn.Embedding(hax.random.normal(k[0], (Vocab, Embed)), Vocab=Vocab, Embed=Embed),
        hnn.Linear(
            weight=hax.random.normal(k[1], (Mlp, Embed)), bias=hax.random.normal(k[2], (Mlp,)), In=Embed, Out=Mlp
        ),
        hnn.Linear(weight=hax.random.normal(k[3], (Mlp, Embed)), bias=None, In=Mlp, Out=Embed),
        hnn.Linear(weight=hax.random.normal(k[4], (Vocab, Embed)), bias=None, In=Embed, Out=Vocab),
        hax.ones(Embed),
    )


def as_plain(t: Tiny) -> dict:
    """Every array in float64; the hidden matrices as ``(out, in)``."""
    arrays = {
        "embedding": t.embedding.weight.array,
        "up": t.up.weight.rearrange(("mlp", "embed")).array,
        "up_bias": t.up.bias.array,
        "down": t.down.weight.rearrange(("embed", "mlp")).array,
        "lm_head": t.lm_head.weight.array,
        "norm": t.norm.array,
    }
    return {k: np.asarray(v, np.float64) for k, v in arrays.items()}


@eqx.filter_jit
def random_like(tree, key):
    leaves, structure = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(structure, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


MATRICES = ("up", "down")
OTHERS = ("embedding", "up_bias", "lm_head", "norm")


@pytest.mark.parametrize("clip", [None, 0.5])
def test_matches_the_papers_equations(clip):
    """Three steps of uScion with decoupled weight decay::

        d_t = (1 - alpha) d_{t-1} + alpha g_t              alpha = 1 - momentum (matrices),
                                                            1 - beta1 (the rest)
        x_{t+1} = x_t + lr_t lmo(d_t) - lr_t wd x_t (decayed parameters)

    with lmo = -sqrt(max(1, d_out/d_in)) U V^T for the hidden matrices and -sign(d) with
    lr * scion_to_signum_lr for the rest, whose gradients are first clipped to a global norm
    (over those parameters only) of ``clip``.
    """
    lr, ratio, momentum, beta1, wd, steps = 0.03, 0.5, 0.9, 0.8, 0.1, 10
    config = scion_config(
        learning_rate=lr,
        scion_to_signum_lr=ratio,
        momentum=momentum,
        beta1=beta1,
        weight_decay=wd,
        backend_steps=steps,
        max_grad_norm=clip,
        warmup=0,
        lr_schedule="constant",
    )
    opt = config.build_for_trainer(10)
    params = tiny(jax.random.PRNGKey(0))
    state = opt.init(params)
    x = as_plain(params)
    d = {k: np.zeros_like(v) for k, v in x.items()}
    decayed = {"up", "down", "lm_head"}  # the default mask: weights of linear layers
    for step in range(3):
        grads = random_like(params, jax.random.PRNGKey(10 + step))
        updates, state = jax.jit(opt.update)(grads, state, params)
        got = as_plain(updates)
        g = as_plain(grads)
        norm = math.sqrt(sum(np.sum(g[k] ** 2) for k in OTHERS))
        factor = 1.0 if clip is None else min(1.0, clip / norm)
        want = {}
        for k in MATRICES:
            d[k] = momentum * d[k] + (1 - momentum) * g[k]
            d_out, d_in = d[k].shape
            want[k] = -lr * (math.sqrt(max(1, d_out / d_in)) * newton_schulz_reference(d[k], steps) + wd * x[k])
        for k in OTHERS:
            d[k] = beta1 * d[k] + (1 - beta1) * factor * g[k]
            want[k] = -lr * ratio * (np.sign(d[k]) + (wd * x[k] if k in decayed else 0))
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=f"{k}, step {step}")
            x[k] = x[k] + want[k]
        params = eqx.apply_updates(params, updates)


def test_spectral_step_is_nearly_the_exact_lmo():
    """With 10 iterations the matrices' step is within the quintic's spread of ``U V^T``: its
    singular values are near 1 (times the shape scale) and its singular vectors are ``d``'s."""
    opt = scion_config(learning_rate=1.0, warmup=0, lr_schedule="constant").build(10)
    params = tiny(jax.random.PRNGKey(1))
    grads = random_like(params, jax.random.PRNGKey(2))
    updates, _ = opt.update(grads, opt.init(params), params)
    step = -as_plain(updates)["up"] / math.sqrt(10 / 6)  # up is 10 x 6
    singular = np.linalg.svd(step, compute_uv=False)
    assert singular.min() > 0.6 and singular.max() < 1.25
    u, _, vt = np.linalg.svd(as_plain(grads)["up"], full_matrices=False)
    assert np.linalg.norm(step - u @ vt, 2) < 0.35


def test_training_lowers_the_loss():
    Gpt2 = registry("model").get("gpt2").config_cls
    config = Gpt2(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16)
    model = eqx.filter_jit(lambda: config.build(hax.Axis("vocab", 64), key=jax.random.PRNGKey(0)))()
    opt = scion_config(learning_rate=0.02, scion_to_signum_lr=0.1, warmup=0).build_for_trainer(20)
    losses = losses_of(opt, model, steps=15)
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.5, losses


def test_levanter_field_names_and_defaults():
    defaults = scion_config()
    assert (defaults.learning_rate, defaults.weight_decay, defaults.max_grad_norm) == (6e-4, 0.0, 1.0)
    assert (defaults.scion_to_signum_lr, defaults.momentum, defaults.backend_steps) == (0.25, 0.95, 10)
    assert (defaults.beta1, defaults.scion_epsilon) == (0.9, 1e-8)
    with pytest.warns(UserWarning, match="optimizer.lr .* no effect"):
        config = scion_config(
            lr=0.02,
            learning_rate=0.01,
            scion_to_signum_lr=0.25,
            momentum=0.95,
            backend_steps=10,
            weight_decay=0.0,
            beta1=0.9,
            scion_epsilon=1e-8,
            max_grad_norm=1.0,
        )
    assert config.learning_rate == 0.01


@pytest.mark.parametrize(
    "field, value",
    [("momentum", 1.0), ("backend_steps", 0), ("scion_to_signum_lr", -0.5), ("scion_epsilon", 0.0), ("beta1", -0.1)],
)
def test_bad_values_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        scion_config(**{field: value})
