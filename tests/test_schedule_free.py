"""``type: schedule_free_adamw``: its steps against optax's and the paper's equations, the
averaged parameters it evaluates, its config, and a short run of the trainer."""

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import schedule_free_adamw, schedule_free_eval_params

from levanter_core.optim import AdamConfig
from levanter_core.optim.schedule_free import ScheduleFreeAdamWConfig, schedule_free_state
from levanter_core.plugins import registry


def tree_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def random_like(tree, key, scale=1.0):
    leaves, structure = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(structure, [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


Embed = hax.Axis("embed", 4)
Hidden = hax.Axis("hidden", 3)


class Tiny(eqx.Module):
    up: hnn.Linear
    norm: hnn.LayerNorm


def tiny_model():
    return Tiny(hnn.Linear.init(Embed, Hidden, key=jax.random.PRNGKey(1)), hnn.LayerNorm.init(Hidden))


# -- the steps --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params", [{"w": jnp.ones((3, 4)), "b": jnp.arange(4.0)}, tiny_model()], ids=["dict", "haliax"]
)
def test_steps_match_optax_schedule_free_adamw(params):
    config = ScheduleFreeAdamWConfig(
        learning_rate=0.05,
        warmup=0,
        beta1=0.9,
        beta2=0.99,
        epsilon=1e-7,
        weight_decay=0.1,
        weight_lr_power=2.0,
        max_grad_norm=None,
        default_weight_decay_mask=False,
    )
    ours = config.build(100)
    theirs = schedule_free_adamw(0.05, b1=0.9, b2=0.99, eps=1e-7, weight_decay=0.1, weight_lr_power=2.0)
    p_ours = p_theirs = params
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    for step in range(6):
        grads = random_like(params, jax.random.PRNGKey(step))
        u_ours, s_ours = ours.update(grads, s_ours, p_ours)
        u_theirs, s_theirs = theirs.update(grads, s_theirs, p_theirs)
        tree_close(u_ours, u_theirs)
        p_ours, p_theirs = optax.apply_updates(p_ours, u_ours), optax.apply_updates(p_theirs, u_theirs)
        tree_close(config.params_for_evaluation(p_ours, s_ours), schedule_free_eval_params(s_theirs, p_theirs))
    # the trained and the evaluated parameters have drifted apart
    assert not np.allclose(jax.tree.leaves(p_ours)[0], jax.tree.leaves(config.params_for_evaluation(p_ours, s_ours))[0])


def paper_steps(config, grads_seq, params, num_train_steps, decayed):
    """Schedule-Free AdamW as the paper writes it, in float64: z takes AdamW steps without
    momentum, x averages the z with weights (max lr so far)**weight_lr_power, gradients are
    taken at y = (1 - beta1) z + beta1 x. Returns (y, x)."""
    schedule = config.lr_scheduler(num_train_steps)
    y = {k: np.asarray(v, np.float64) for k, v in params.items()}
    z, x = dict(y), dict(y)
    nu = {k: np.zeros_like(v) for k, v in y.items()}
    lr_max = total_weight = 0.0
    for t, grads in enumerate(grads_seq):
        g = {k: np.asarray(v, np.float64) for k, v in grads.items()}
        norm = np.sqrt(sum((v**2).sum() for v in g.values()))
        if config.max_grad_norm is not None and norm > config.max_grad_norm:
            g = {k: v * config.max_grad_norm / norm for k, v in g.items()}
        lr = float(schedule(t))
        lr_max = max(lr_max, lr)
        weight = lr_max**config.weight_lr_power
        total_weight += weight
        c = weight / total_weight if total_weight > 0 else 0.0
        for k in y:
            nu[k] = config.beta2 * nu[k] + (1 - config.beta2) * g[k] ** 2
            nu_hat = nu[k] / (1 - config.beta2 ** (t + 1))
            step = g[k] / (np.sqrt(nu_hat) + config.epsilon) + (config.weight_decay * y[k] if k in decayed else 0.0)
            z[k] = z[k] - lr * step
            x[k] = (1 - c) * x[k] + c * z[k]
            y[k] = config.beta1 * x[k] + (1 - config.beta1) * z[k]
    return y, x


def test_warmup_clipping_and_the_decay_mask_follow_the_paper():
    config = ScheduleFreeAdamWConfig(
        learning_rate=0.1,
        warmup=4,
        beta1=0.95,
        weight_decay=0.2,
        weight_lr_power=2.0,
        max_grad_norm=1.5,
        weight_decay_modules="^weight$",
    )
    params = {"weight": jnp.linspace(-1, 1, 12).reshape(3, 4), "bias": jnp.ones(4)}
    grads_seq = [random_like(params, jax.random.PRNGKey(10 + t), scale=0.3 + t % 3) for t in range(8)]
    opt = config.build_for_trainer(40)
    state, p = opt.init(params), params
    for grads in grads_seq:
        updates, state = opt.update(grads, state, p, loss=jnp.asarray(1.0))
        p = optax.apply_updates(p, updates)
    y, x = paper_steps(config, grads_seq, params, 40, decayed={"weight"})
    tree_close(p, y)
    tree_close(config.params_for_evaluation(p, state), x)
    # the first step's learning rate is 0 (warmup starts at 0, as for AdamW): it leaves y where
    # it was (up to rounding: optax recomputes x from y and z)
    first, _ = config.build(40).update(grads_seq[0], config.build(40).init(params), params)
    tree_close(first, jax.tree.map(jnp.zeros_like, first), rtol=0, atol=1e-7)


def test_eval_params_are_found_inside_the_trainers_wrappers():
    config = ScheduleFreeAdamWConfig(learning_rate=0.05, warmup=0, skip_bad_steps=True)
    opt = config.build_for_trainer(10)
    params = {"w": jnp.arange(3.0)}
    state = opt.init(params)
    for t in range(3):
        updates, state = opt.update({"w": jnp.array([1.0, -2.0, 0.5]) * (t + 1)}, state, params, loss=jnp.asarray(1.0))
        params = optax.apply_updates(params, updates)
    inner = schedule_free_state(state)
    assert inner is state.inner_state[1]  # inside skip-step and after the clipping
    tree_close(config.params_for_evaluation(params, state), schedule_free_eval_params(inner, params))
    with pytest.raises(ValueError, match="found 0"):
        config.params_for_evaluation(params, AdamConfig().build_for_trainer(10).init(params))


# -- the config -------------------------------------------------------------------------------


def test_config_loads_from_its_registry_name_with_documented_defaults():
    cls = registry("optimizer").get("schedule_free_adamw").config_cls
    assert cls is ScheduleFreeAdamWConfig
    config = cls.model_validate({"type": "schedule_free_adamw", "learning_rate": 3e-3, "warmup": 100, "beta1": 0.95})
    assert (config.beta1, config.beta2, config.epsilon, config.max_grad_norm, config.weight_lr_power) == (
        0.95,
        0.95,
        1e-8,
        1.0,
        2.0,
    )
    assert config.lr_schedule == "constant"
    schedule = config.lr_scheduler(1000)
    assert [float(schedule(s)) for s in (0, 50, 100, 999)] == pytest.approx([0.0, 1.5e-3, 3e-3, 3e-3])


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"lr_schedule": "cosine"}, "lr_schedule must be constant .*not 'cosine'"),
        ({"lr_schedule": {"type": "power", "batch_size": 8, "seq_length": 8}}, "not 'power'"),
        ({"cooldown": 0.1}, "remove cooldown"),
        ({"decay": 0.2}, "decay only shape a decay.*remove it"),
        ({"cycles": 2, "rewarmup": 5}, "cycles, rewarmup only shape a decay.*remove them"),
        ({"beta1": 0.0}, "greater than 0"),
        ({"beta2": 1.0}, "less than 1"),
        ({"weight_lr_power": -1}, "greater than or equal to 0"),
    ],
)
def test_bad_values_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        ScheduleFreeAdamWConfig(**fields)


# -- in the trainer ---------------------------------------------------------------------------


def test_the_trainer_trains_and_evaluates_the_average(tmp_path):
    from levanter_core.objective import LmObjective
    from levanter_core.trainer.config import TrainerConfig
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer, trainable

    Gpt2 = registry("model").get("gpt2").config_cls
    model_config = Gpt2(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16)
    trainer_config = TrainerConfig(train_batch_size=4, num_train_steps=20)
    opt_config = ScheduleFreeAdamWConfig(learning_rate=1e-2, warmup=2, weight_decay=0.0)
    trainer = Trainer(
        trainer_config,
        opt_config.build_for_trainer(trainer_config.num_train_steps),
        LmObjective(),
        mesh=make_mesh(trainer_config),
        eval_params=opt_config.params_for_evaluation,
    )
    state = trainer.init_state(lambda key: model_config.build(hax.Axis("vocab", 64), key=key), jax.random.PRNGKey(0))
    batch = np.random.default_rng(0).integers(0, 64, (4, 16))
    losses = []
    for _ in range(8):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["train/loss"]))
    assert losses[-1] < losses[0] - 0.5, losses

    evaluated = trainer.eval_model(state)
    expected = schedule_free_eval_params(schedule_free_state(state.opt_state), trainable(state.model))
    tree_close(trainable(evaluated), expected)
    trained, averaged = jax.tree.leaves(trainable(state.model)), jax.tree.leaves(trainable(evaluated))
    assert any(not np.allclose(a, b) for a, b in zip(trained, averaged))
    assert jax.tree.structure(evaluated) == jax.tree.structure(state.model)
