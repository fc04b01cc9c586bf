"""MARS against the paper's equations written out in numpy, and against optax's AdamW when
gamma is 0."""

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from levanter_core.plugins import registry
from levanter_optim_contrib.mars import MarsConfig
from levanter_optim_contrib.tests.shared import apply_steps, assert_refused, losses_of


@pytest.fixture(scope="module")
def gpt2():
    Gpt2 = registry("model").get("gpt2").config_cls
    config = Gpt2(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16)
    return config.build(hax.Axis("vocab", 64), key=jax.random.PRNGKey(0))


def random_grads(params, rng, scale):
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([jnp.asarray(rng.normal(size=x.shape) * scale, jnp.float32) for x in leaves])


def mars_numpy(params, grads, *, lr, beta1, beta2, gamma, eps, max_norm, wd, decayed):
    """MARS-AdamW (Yuan et al. 2024, Algorithm 2 with the approximate correction) in float64 on
    lists of arrays. Returns the parameters after each step and whether each step clipped."""
    p = [np.asarray(x, np.float64) for x in params]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    previous = [np.zeros_like(x) for x in p]
    history, clipped = [], []
    for t, g in enumerate(grads, start=1):
        g = [np.asarray(x, np.float64) for x in g]
        c = [gi + gamma * beta1 / (1 - beta1) * (gi - pi) for gi, pi in zip(g, previous)]
        norm = np.sqrt(sum(np.sum(ci**2) for ci in c))
        clipped.append(bool(max_norm and norm > max_norm))
        if clipped[-1]:
            c = [ci * max_norm / norm for ci in c]
        m = [beta1 * mi + (1 - beta1) * ci for mi, ci in zip(m, c)]
        v = [beta2 * vi + (1 - beta2) * ci**2 for vi, ci in zip(v, c)]
        step = [
            (mi / (1 - beta1**t)) / (np.sqrt(vi / (1 - beta2**t)) + eps) + (wd * pi if d else 0.0)
            for mi, vi, pi, d in zip(m, v, p, decayed)
        ]
        p = [pi - lr * si for pi, si in zip(p, step)]
        previous = g
        history.append(p)
    return history, clipped


def run(optimizer, params, grads):
    return apply_steps(optimizer, params, grads, lambda p: [np.asarray(x) for x in jax.tree.leaves(p)])[0]


def constant_lr(**fields):
    return MarsConfig(learning_rate=0.01, warmup=0, lr_schedule="constant", **fields)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_the_papers_equations_on_a_named_model(gpt2, wd):
    config = constant_lr(gamma=0.3, beta1=0.9, beta2=0.99, weight_decay=wd)
    rng = np.random.default_rng(0)
    # global norms ~0.2 to ~8, so that some corrected gradients are clipped and some are not
    grads = [random_grads(gpt2, rng, s) for s in (1e-3, 5e-2, 2e-3, 3e-2)]
    decayed = jax.tree.leaves(config.build_weight_decay_mask()(gpt2))

    got = run(config.build(10), gpt2, grads)
    want, clipped = mars_numpy(
        jax.tree.leaves(gpt2),
        [jax.tree.leaves(g) for g in grads],
        lr=0.01,
        beta1=0.9,
        beta2=0.99,
        gamma=0.3,
        eps=1e-8,
        max_norm=1.0,
        wd=wd,
        decayed=decayed,
    )
    assert clipped[0] is False and clipped[1] is True
    for got_step, want_step in zip(got, want):
        for x, y in zip(got_step, want_step):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_matches_the_papers_equations_on_plain_arrays_without_clipping():
    rng = np.random.default_rng(1)
    params = {"a": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.zeros(5)}
    grads = [random_grads(params, rng, 10.0) for _ in range(5)]
    config = constant_lr(max_grad_norm=None, weight_decay=0.0)

    got = run(config.build(10), params, grads)
    want, _ = mars_numpy(
        jax.tree.leaves(params),
        [jax.tree.leaves(g) for g in grads],
        lr=0.01,
        beta1=0.95,
        beta2=0.99,
        gamma=0.025,
        eps=1e-8,
        max_norm=None,
        wd=0.0,
        decayed=[False, False],
    )
    for got_step, want_step in zip(got, want):
        for x, y in zip(got_step, want_step):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_without_correction_it_is_optax_adamw_with_clipping(gpt2):
    config = constant_lr(gamma=0.0, weight_decay=0.1)
    adamw = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(0.01, b1=0.95, b2=0.99, eps=1e-8, weight_decay=0.1, mask=config.build_weight_decay_mask()),
    )
    rng = np.random.default_rng(2)
    grads = [random_grads(gpt2, rng, s) for s in (1e-3, 5e-2, 2e-3, 3e-2, 1e-3)]
    for got_step, want_step in zip(run(config.build(10), gpt2, grads), run(adamw, gpt2, grads)):
        for x, y in zip(got_step, want_step):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_state_keeps_the_last_raw_gradient():
    opt = constant_lr().build(10)
    params = {"w": jnp.zeros(3)}
    grads = {"w": jnp.array([30.0, -40.0, 0.0])}  # long enough to be clipped
    _, state = opt.update(grads, opt.init(params), params)
    np.testing.assert_array_equal(state[0].previous_grad["w"], grads["w"])


def test_loads_levanters_fields_and_defaults():
    cls = registry("optimizer").get("mars").config_cls
    assert cls is MarsConfig
    default = cls.model_validate({"type": "mars"})
    assert (default.beta1, default.beta2, default.gamma, default.epsilon) == (0.95, 0.99, 0.025, 1e-8)
    assert (default.max_grad_norm, default.weight_decay) == (1.0, 0.1)

    config = cls.model_validate(
        {
            "type": "mars",
            "learning_rate": 3e-3,
            "weight_decay": 0.05,
            "beta1": 0.9,
            "beta2": 0.999,
            "gamma": 0.05,
            "epsilon": 1e-6,
            "max_grad_norm": None,
            "warmup": 0.1,
            "lr_schedule": "linear",
        }
    )
    assert (config.beta1, config.beta2, config.gamma, config.epsilon) == (0.9, 0.999, 0.05, 1e-6)
    assert config.max_grad_norm is None and config.weight_decay == 0.05


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"beta1": 1.0}, r"optimizer\.beta1 .*less than 1"),
        ({"beta2": -0.1}, r"optimizer\.beta2 .*greater than or equal to 0"),
        ({"gamma": -0.5}, r"optimizer\.gamma .*greater than or equal to 0"),
        ({"max_grad_norm": -1.0}, r"optimizer\.max_grad_norm .*greater than or equal to 0"),
        ({"b1": 0.9}, r"optimizer\.b1 .*unknown field"),
    ],
)
def test_bad_values_name_the_field(tmp_path, fields, message):
    assert_refused(tmp_path, {"type": "mars", **fields}, message)


def test_training_the_tiny_gpt2_lowers_the_loss(gpt2):
    losses = losses_of(MarsConfig(learning_rate=1e-2, warmup=0).build_for_trainer(20), gpt2, steps=20)
    assert losses[-1] < losses[0] - 1.0, losses
