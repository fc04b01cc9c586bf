"""Model averaging (``trainer.model_averaging``): the averaging rules, the config, and a run whose
checkpoints hold the averaged weights and resume them exactly."""

import os
import shutil

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from test_trainer import read_metrics, tiny_config

from levanter_core.checkpoint import read_metadata
from levanter_core.config.loader import Sources
from levanter_core.config.train import validate_train_config
from levanter_core.errors import ConfigError
from levanter_core.models.lm import lm_loss_and_metrics
from levanter_core.optim import AdamConfig, EmaDecaySqrtConfig, EmaModelAveragingConfig
from levanter_core.run import run_training
from levanter_core.trainer.mesh import make_mesh
from levanter_core.trainer.trainer import Trainer


def as_model(value: float) -> dict:
    """A stand-in model: one float parameter and one integer array that must not be averaged."""
    return {"w": jnp.full((2,), value, jnp.float32), "ids": jnp.array([int(value), 7], jnp.int32)}


def fold_all(averaging, steps_and_values):
    """Fold ``as_model(value)`` in after each ``step``, through a jitted update (traced step)."""
    update = eqx.filter_jit(lambda avg, model, step: avg.update(model, step))
    for step, value in steps_and_values:
        averaging = update(averaging, as_model(value), jnp.asarray(step, jnp.int32))
    return averaging


# -- the averaging rules ----------------------------------------------------------------------


def test_ema_matches_a_hand_computation():
    averaging = EmaModelAveragingConfig(beta=0.9).create(as_model(0.0))
    averaging = fold_all(averaging, [(0, 10.0), (1, 20.0), (2, 30.0)])
    # 0 -> 0.9*0 + 0.1*10 = 1 -> 0.9*1 + 0.1*20 = 2.9 -> 0.9*2.9 + 0.1*30 = 5.61
    np.testing.assert_allclose(averaging.model["w"], [5.61, 5.61], rtol=1e-6)
    # integer arrays are not averaged: they follow the newest model
    np.testing.assert_array_equal(averaging.model["ids"], [30, 7])


def test_ema_keeps_the_parameter_precision():
    model = {"w": jnp.ones((3,), jnp.bfloat16)}
    averaging = EmaModelAveragingConfig(beta=0.5).create(model)
    averaging = averaging.update({"w": jnp.full((3,), 3.0, jnp.bfloat16)}, jnp.asarray(0))
    assert averaging.model["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(averaging.model["w"].astype(jnp.float32), [2.0, 2.0, 2.0])


def test_ema_decay_sqrt_weights_before_and_after_the_switch():
    config = EmaDecaySqrtConfig(beta=0.5, switch_step=4, decay_steps=4, epsilon=0.01)
    averaging = config.create(as_model(0.0))
    weights = [float(averaging.new_model_weight(jnp.asarray(s))) for s in (0, 3, 4, 5, 6, 7, 8, 100)]
    expected = [0.5, 0.5, 1.0, 1 - 0.25**0.5, 1 - 0.5**0.5, 1 - 0.75**0.5, 0.01, 0.01]
    np.testing.assert_allclose(weights, expected, rtol=1e-6)


def test_ema_decay_sqrt_matches_a_hand_computation():
    config = EmaDecaySqrtConfig(beta=0.5, switch_step=4, decay_steps=4, epsilon=0.01)
    averaging = fold_all(config.create(as_model(0.0)), [(3, 10.0)])
    np.testing.assert_allclose(averaging.model["w"], [5.0, 5.0])  # EMA: 0.5*0 + 0.5*10
    averaging = fold_all(averaging, [(4, 20.0)])
    np.testing.assert_allclose(averaging.model["w"], [20.0, 20.0])  # the switch restarts the average
    averaging = fold_all(averaging, [(5, 40.0)])
    np.testing.assert_allclose(averaging.model["w"], [30.0, 30.0], rtol=1e-6)  # weight 1 - sqrt(1/4)
    averaging = fold_all(averaging, [(8, 1000.0)])
    np.testing.assert_allclose(averaging.model["w"], [0.99 * 30 + 0.01 * 1000] * 2, rtol=1e-6)  # epsilon


# -- config ------------------------------------------------------------------------------------


def train_config(tmp_path, **trainer):
    raw = {
        "data": {"type": "python_stdlib", "tokenizer": "byte", "cache_dir": str(tmp_path)},
        "model": {"type": "gpt2"},
        "trainer": trainer,
    }
    return validate_train_config(raw, Sources("run.yaml"))


def test_model_averaging_section_is_chosen_by_type(tmp_path):
    assert train_config(tmp_path).trainer.model_averaging is None
    config = train_config(tmp_path, model_averaging={"type": "ema_decay_sqrt", "switch_step": 10})
    assert config.trainer.model_averaging == EmaDecaySqrtConfig(switch_step=10)
    assert train_config(tmp_path, model_averaging={"type": "ema"}).trainer.model_averaging.beta == 0.999


@pytest.mark.parametrize(
    "section, message",
    [
        ({"type": "swa"}, r"trainer\.model_averaging .*'swa'.*'ema', 'ema_decay_sqrt'"),
        ({"type": "ema", "beta": 1.5}, r"trainer\.model_averaging\.ema\.beta .*less than 1 \(got 1\.5\)"),
        ({"type": "ema_decay_sqrt", "decay_steps": 0}, r"decay_steps .*greater than or equal to 1"),
    ],
)
def test_bad_model_averaging_sections_are_config_errors(tmp_path, section, message):
    with pytest.raises(ConfigError, match=message):
        train_config(tmp_path, model_averaging=section)


# -- a training run ------------------------------------------------------------------------------


def stored_array(checkpoint: str, name: str) -> np.ndarray:
    """One array of a checkpoint, read straight from its zarr directory."""
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(checkpoint, name)}}
    return ts.open(spec).result().read().result()


def test_checkpoints_hold_the_averaged_weights_and_resume_them_exactly(tmp_path):
    config = tiny_config(tmp_path, model_averaging={"type": "ema", "beta": 0.9})
    first = run_training(config, progress=False)
    run_dir = tmp_path / "logs" / "tiny"
    full = {m["step"]: m["train/loss"] for m in read_metrics(run_dir) if "train/loss" in m}

    leaves = {leaf["name"]: leaf for leaf in read_metadata(first.checkpoint)["leaves"]}
    model_leaves = [name for name in leaves if name.startswith("model/")]
    averaged = [name for name in leaves if name.startswith("model_averaging/")]
    assert averaged == ["model_averaging/" + name for name in model_leaves]
    for name in model_leaves:
        assert leaves["model_averaging/" + name]["dtype"] == leaves[name]["dtype"] == "float32"
        assert leaves["model_averaging/" + name]["shape"] == leaves[name]["shape"]
    weight = "model/embeddings/token_embeddings/weight"
    averaged_at_30 = stored_array(first.checkpoint, "model_averaging/" + weight)
    # an average of recent weights, not the weights themselves
    assert not np.allclose(averaged_at_30, stored_array(first.checkpoint, weight))

    for step in (20, 30):  # as if the run had been killed after step 10
        shutil.rmtree(tmp_path / "ckpt" / "tiny" / f"step-{step}")
    resumed = run_training(config, progress=False)
    assert resumed.start_step == 10 and resumed.final_step == 30
    again = [m for m in read_metrics(run_dir) if "train/loss" in m]
    assert [m["step"] for m in again] == list(range(1, 31))
    assert [m["train/loss"] for m in again[10:]] == [full[step] for step in range(11, 31)]
    np.testing.assert_array_equal(stored_array(resumed.checkpoint, "model_averaging/" + weight), averaged_at_30)


def trainer_and_state(config, vocab_size: int = 50):
    """A Trainer for ``config`` (AdamW, lr 1e-2) and its fresh state."""
    Vocab = hax.Axis("vocab", vocab_size)
    optimizer = AdamConfig(learning_rate=1e-2, warmup=0).build_for_trainer(config.trainer.num_train_steps)
    trainer = Trainer(config.trainer, optimizer, lm_loss_and_metrics, mesh=make_mesh(config.trainer))
    state = trainer.init_state(lambda key: config.model.build(Vocab, key=key), jax.random.PRNGKey(0))
    return trainer, state


def test_the_trainer_evaluates_the_average_sharded_like_the_model(tmp_path):
    tokens = np.arange(8 * 64).reshape(8, 64) % 50
    trainer, state = trainer_and_state(tiny_config(tmp_path, model_averaging={"type": "ema", "beta": 0.5}))
    initial = np.asarray(state.model.embeddings.token_embeddings.weight.array)
    state, _ = trainer.train_step(state, tokens)

    averaged = trainer.eval_model(state).embeddings.token_embeddings.weight.array
    trained = state.model.embeddings.token_embeddings.weight.array
    assert not np.allclose(trained, initial)
    np.testing.assert_allclose(averaged, 0.5 * initial + 0.5 * np.asarray(trained), rtol=1e-6)
    assert averaged.sharding == trained.sharding

    plain_trainer, plain_state = trainer_and_state(tiny_config(tmp_path))
    assert plain_state.model_averaging is None
    assert plain_trainer.eval_model(plain_state) is plain_state.model
