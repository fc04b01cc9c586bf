"""Sophia-H and Sophia-G: the update against optax.contrib.sophia, the two Hessian estimates
against their equations, and training through the real trainer. (Against Levanter's own Sophia:
tests/test_sophia_levanter.py.)"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from pydantic import ValidationError

from levanter_core.optim import BatchObjective
from levanter_optim_contrib.sophia import (
    SophiaGConfig,
    SophiaHConfig,
    SophiaState,
    _random_like,
    gauss_newton_bartlett_estimate,
    hutchinson_estimate,
)

Row, Col = hax.Axis("row", 3), hax.Axis("col", 4)


def quadratic_objective(diagonal: dict, centre: float = 0.0) -> tuple[BatchObjective, callable]:
    """``f(p) = 1/2 sum d * (p - centre)^2`` over a tree of named arrays, as a trainer would hand it."""

    def f(params):
        return sum(0.5 * jnp.sum(d * (p.array - centre) ** 2) for d, p in zip(diagonal.values(), params.values()))

    def unused(*_):
        raise AssertionError("not drawn")

    return BatchObjective(lambda p, key: f(p), unused, lambda: jnp.float32(1)), f


CONFIG = dict(
    learning_rate=0.05,
    warmup=0,
    lr_schedule="constant",
    weight_decay=0.01,
    default_weight_decay_mask=False,
    beta1=0.9,
    gamma=0.02,
    epsilon=1e-8,
)
OPTAX = dict(b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.01, gamma=0.02, clip_threshold=1.0)


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    diagonal = {"a": rng.uniform(0.1, 5, (3, 4)).astype(np.float32), "b": rng.uniform(0.1, 5, (4,)).astype(np.float32)}
    params = {
        "a": hax.named(rng.normal(size=(3, 4)).astype(np.float32), (Row, Col)),
        "b": hax.named(rng.normal(size=4).astype(np.float32), (Col,)),
    }
    return rng, diagonal, params


def _raw(tree):
    return jax.tree.map(lambda x: x.array if hax.is_named_array(x) else x, tree, is_leaf=hax.is_named_array)


@pytest.mark.parametrize("count", [3, 9])
def test_one_update_matches_optax_contrib_sophia(count):
    """From the same state, one step: the updates and the momentum agree with optax's, both
    dividing by the moving average of the earlier estimates. The new estimate comes at the end
    of the step that completes an interval (from count 9, the 10th step), where optax makes it
    at the start of the next (from count 10): the new average agrees with optax's there (random
    signs on a diagonal quadratic make ``v * (H v)`` exactly the diagonal, whatever the key)."""
    rng, diagonal, params = _problem()
    objective, f = quadratic_objective(diagonal)
    ours = SophiaHConfig(**CONFIG, random_vectors="rademacher", update_interval=10).build(100)
    theirs = optax.contrib.sophia(0.05, update_interval=10, **OPTAX)
    mu = {k: rng.normal(size=d.shape).astype(np.float32) for k, d in diagonal.items()}
    h = {k: rng.uniform(5, 200, d.shape).astype(np.float32) for k, d in diagonal.items()}
    named = lambda tree: {k: hax.named(v, params[k].axes) for k, v in tree.items()}
    ours_state = ours.init(params)
    ours_state = (ours_state[0]._replace(count=jnp.int32(count), mu=named(mu), h=named(h)), *ours_state[1:])
    theirs_state = theirs.init(_raw(params))
    at = lambda c: (theirs_state[0]._replace(count=jnp.int32(c), mu=mu, nu=h), *theirs_state[1:])

    grads = eqx.filter_grad(f)(params)
    plain_f = lambda r: f({k: hax.named(v, params[k].axes) for k, v in r.items()})
    u, ours_after = ours.update(grads, ours_state, params, objective=objective)
    v, theirs_after = theirs.update(_raw(grads), at(count), _raw(params), obj_fn=plain_f)
    if count % 10 == 9:  # optax's estimate, one step later
        _, theirs_after = theirs.update(_raw(grads), at(count + 1), _raw(params), obj_fn=plain_f)
    for name in params:
        np.testing.assert_allclose(np.asarray(ours_after[0].mu[name].array), theirs_after[0].mu[name], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(ours_after[0].h[name].array), theirs_after[0].nu[name], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(u[name].array), np.asarray(v[name]), rtol=1e-5, atol=1e-7)
    changed = not np.allclose(np.asarray(ours_after[0].h["a"].array), h["a"])
    assert changed == (count % 10 == 9)


def test_25_steps_follow_levanters_order():
    """Sophia-H in float64 numpy, in Levanter's order: each step divides by the moving average of
    the estimates made before it; the estimates come at the end of steps 5, 10, 15 and 20, at
    the parameters those steps start from (so steps 1 to 5 divide by epsilon). Gamma and beta2
    are such that most coordinates are not clipped once the estimates are in."""
    _, diagonal, params = _problem(1)
    objective, f = quadratic_objective(diagonal, centre=0.5)
    config = {**CONFIG, "gamma": 2.0, "beta2": 0.5}
    ours = SophiaHConfig(**config, random_vectors="rademacher", update_interval=5).build(100)
    state = ours.init(params)
    theta = {k: np.asarray(v.array, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    h = {k: np.zeros_like(v) for k, v in theta.items()}
    unclipped = []

    @eqx.filter_jit
    def step(params, state):  # one compiled program rather than each step's ops one by one
        u, state = ours.update(eqx.filter_grad(f)(params), state, params, objective=objective)
        return optax.apply_updates(params, u), state

    for t in range(1, 26):
        params, state = step(params, state)
        inside = 0
        for k in theta:
            g = diagonal[k] * (theta[k] - 0.5)
            m[k] = 0.9 * m[k] + 0.1 * g
            ratio = (m[k] / (1 - 0.9**t)) / np.maximum(2.0 * h[k], 1e-8)
            inside += np.sum(np.abs(ratio) < 1)
            if t % 5 == 0:
                h[k] = 0.5 * h[k] + 0.5 * diagonal[k]
            theta[k] = theta[k] - 0.05 * (np.clip(ratio, -1, 1) + 0.01 * theta[k])
        unclipped.append(inside / 16)
    for k in theta:
        np.testing.assert_allclose(np.asarray(params[k].array), theta[k], rtol=2e-5, atol=1e-6)
    assert max(unclipped[:5]) == 0 and min(unclipped[5:]) > 0.5


def test_hutchinson_estimate_is_v_times_hessian_times_v_and_averages_to_the_diagonal():
    rng = np.random.default_rng(1)
    m = rng.normal(size=(5, 5))
    a = (m @ m.T + np.eye(5)).astype(np.float32)  # a full symmetric Hessian
    objective = BatchObjective(lambda p, key: 0.5 * p["x"] @ (a @ p["x"]), None, None)
    params = {"x": jnp.asarray(rng.normal(size=5), jnp.float32)}
    estimate = hutchinson_estimate("gaussian")
    key = jax.random.PRNGKey(3)
    v = np.asarray(_random_like(key, params, "gaussian")["x"], np.float64)
    np.testing.assert_allclose(np.asarray(estimate(objective, params, key)["x"]), v * (a @ v), rtol=1e-4, atol=1e-5)
    many = jax.vmap(lambda k: estimate(objective, params, k)["x"])(jax.random.split(key, 4000))
    # off-diagonal terms average out: the mean is the diagonal within a few standard errors
    spread = np.asarray(many).std(axis=0) / np.sqrt(4000)
    assert np.all(np.abs(np.asarray(many).mean(axis=0) - np.diag(a)) < 5 * spread)


def test_gauss_newton_bartlett_estimate_follows_the_papers_algorithm_2():
    """Softmax regression: ghat is the gradient of the mean loss against drawn labels, computed
    here by hand as (1/B) sum_b (softmax(W x_b) - onehot(yhat_b)) x_b^T; the estimate is B ghat^2."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 4)).astype(np.float32)  # B = 6 points, 4 features, 3 classes
    params = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)}

    def draw(w, key):
        return jax.random.categorical(key, jax.lax.stop_gradient(x @ w.T))

    def sampled_loss(p, key):
        logits = x @ p["w"].T
        labels = draw(p["w"], key)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    objective = BatchObjective(None, sampled_loss, lambda: jnp.float32(6))
    key = jax.random.PRNGKey(7)
    got = np.asarray(gauss_newton_bartlett_estimate(objective, params, key)["w"])

    w = np.asarray(params["w"], np.float64)
    labels = np.asarray(draw(params["w"], key))
    logits = x.astype(np.float64) @ w.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ghat = (p - np.eye(3)[labels]).T @ x / 6
    np.testing.assert_allclose(got, 6 * ghat**2, rtol=1e-4, atol=1e-7)


def test_lm_targets_are_drawn_from_the_models_own_distribution():
    from levanter_core.models.cross_entropy import sample_tokens

    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(1, 1, 8)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
    p = np.asarray(jax.nn.softmax(hidden[0, 0] @ head))
    draws = jax.vmap(lambda k: sample_tokens(hidden, head, k, block=1)[0, 0])(
        jax.random.split(jax.random.PRNGKey(0), 20000)
    )
    freq = np.bincount(np.asarray(draws), minlength=5) / 20000
    assert np.all(np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / 20000) + 1e-3), (freq, p)


def test_levanter_field_names_and_defaults():
    h = SophiaHConfig.model_validate(
        {"learning_rate": 6e-4, "weight_decay": 0.2, "min_lr_ratio": 0.1, "gamma": 0.01, "warmup": 2000}
    )
    assert (h.beta1, h.beta2, h.epsilon, h.clip_threshold, h.update_interval, h.rng_seed) == (
        0.96,
        0.99,
        1e-12,
        1.0,
        10,
        0,
    )
    assert SophiaHConfig().gamma == 0.01 and SophiaGConfig().gamma == 0.05
    with pytest.raises(ValidationError, match="update_interval"):
        SophiaHConfig(update_interval=0)
    with pytest.raises(ValidationError, match="gamma"):
        SophiaGConfig(gamma=-1.0)


# -- through the trainer --------------------------------------------------------------------------


def _sophia_state(opt_state) -> SophiaState:
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SophiaState))
        if isinstance(s, SophiaState)
    ]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("config", [SophiaHConfig, SophiaGConfig])
def test_training_a_tiny_gpt2_estimates_every_interval_and_lowers_the_loss(config):
    from levanter_core.objective import LmObjective
    from levanter_core.plugins import registry
    from levanter_core.trainer.config import TrainerConfig
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer

    gpt2 = registry("model").get("gpt2").config_cls(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16)
    trainer_config = TrainerConfig(train_batch_size=8, num_train_steps=12)
    optimizer = config(learning_rate=1e-2, warmup=0, update_interval=4).build_for_trainer(12)
    trainer = Trainer(trainer_config, optimizer, LmObjective(), mesh=make_mesh(trainer_config))
    state = trainer.init_state(lambda k: gpt2.build(hax.Axis("vocab", 32), key=k), jax.random.PRNGKey(0))
    tokens = np.tile(np.arange(16) % 7, (8, 1))  # a pattern the model can learn in a few steps
    losses, norms = [], []
    for _ in range(12):
        state, metrics = trainer.train_step(state, tokens)
        losses.append(float(metrics["train/loss"]))
        norms.append(float(optax.global_norm(_sophia_state(state.opt_state).h)))
        assert 0 < float(metrics["optim/unclipped_fraction"]) <= 1
    changed = [i for i in range(12) if norms[i] != (norms[i - 1] if i else 0.0)]
    assert changed == [3, 7, 11]  # the estimate runs at the end of steps 4, 8 and 12 only
    assert losses[-1] < 0.7 * losses[0]
