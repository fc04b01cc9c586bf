"""What the trainer hands every optimizer's ``update`` besides the gradients
(levanter_core.optim.step): the objective on the step's batch, a key and the step count."""

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from levanter_core.objective import LmObjective
from levanter_core.optim import hessian_vector_product
from levanter_core.plugins import registry
from levanter_core.tracker.jit_log import jit_log
from levanter_core.trainer.config import TrainerConfig
from levanter_core.trainer.mesh import make_mesh
from levanter_core.trainer.trainer import Trainer


def probe() -> optax.GradientTransformationExtraArgs:
    """Plain SGD that logs what it received."""

    def update(grads, state, params=None, *, loss, objective, key, step, **_):
        jit_log({
            "probe/step": step.astype(jnp.float32),
            "probe/loss_again": objective.loss(params),
            "probe/data_points": objective.data_points(),
            "probe/key": jax.random.uniform(key),
            "probe/sampled_loss": objective.sampled_loss(params, key),
        })  # fmt: skip
        return jax.tree.map(lambda g: -0.1 * g, grads), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def trainer_and_state(**trainer):
    gpt2 = registry("model").get("gpt2").config_cls(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16)
    config = TrainerConfig(train_batch_size=8, num_train_steps=4, mp="p=f32", **trainer)
    t = Trainer(config, probe(), LmObjective(), mesh=make_mesh(config))
    return t, t.init_state(lambda k: gpt2.build(hax.Axis("vocab", 32), key=k), jax.random.PRNGKey(0))


TOKENS = np.random.default_rng(0).integers(0, 32, (8, 16))


def test_the_objective_is_the_steps_loss_and_the_key_is_the_steps_own():
    trainer, state = trainer_and_state()
    seen = []
    for _ in range(3):
        state, metrics = trainer.train_step(state, TOKENS)
        seen.append({k: float(v) for k, v in metrics.items() if k.startswith("probe/") or k == "train/loss"})
    assert [s["probe/step"] for s in seen] == [0, 1, 2]
    for s in seen:
        assert s["probe/loss_again"] == pytest.approx(s["train/loss"], rel=1e-6)
        assert s["probe/data_points"] == 8 * 15  # every position but the last predicts a token
        # drawn targets are no better than the batch's: the loss is close but not the same
        assert s["probe/sampled_loss"] != s["train/loss"] and abs(s["probe/sampled_loss"] - s["train/loss"]) < 1
    assert len({s["probe/key"] for s in seen}) == 3
    # the same state gives the same key: a resumed run draws what the uninterrupted one drew
    _, again = trainer_and_state()
    _, metrics = trainer.train_step(again, TOKENS)
    assert float(metrics["probe/key"]) == seen[0]["probe/key"]


def test_with_microbatches_the_objective_sees_the_first_one():
    trainer, state = trainer_and_state(per_device_parallelism=2)
    assert trainer.plan.num_microbatches == 4
    _, metrics = trainer.train_step(state, TOKENS)
    assert float(metrics["probe/data_points"]) == 2 * 15


def test_hessian_vector_product_of_a_quadratic():
    a = jnp.asarray([[2.0, 1.0], [1.0, 3.0]])
    v = {"x": jnp.asarray([1.0, -2.0])}
    hv = hessian_vector_product(lambda p: 0.5 * p["x"] @ a @ p["x"] + jnp.sum(p["x"] ** 3) / 6, {"x": jnp.ones(2)}, v)
    np.testing.assert_allclose(hv["x"], a @ v["x"] + np.ones(2) * v["x"], rtol=1e-6)  # + diag(x) from the cubic
