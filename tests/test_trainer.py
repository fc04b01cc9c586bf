"""Training: gradient accumulation, a short real run whose loss falls, and resume."""

import os
import shutil

import haliax as hax
import jax
import numpy as np
import pytest

from levanter_core.config.loader import Sources
from levanter_core.config.train import TrainConfig, validate_train_config
from levanter_core.models.lm import lm_loss_and_metrics
from levanter_core.run import run_training
from levanter_core.testing import read_metrics, tiny_model
from levanter_core.trainer.mesh import make_mesh
from levanter_core.trainer.trainer import Trainer, trainable


def tiny_config(tmp_path, *, model: dict | None = None, optimizer: dict | None = None, **trainer) -> TrainConfig:
    """A tiny GPT-2 run; ``model`` and ``optimizer`` fields and ``trainer`` ones override its own."""
    raw = {
        "data": {"type": "python_stdlib", "tokenizer": "byte", "max_files": 40, "cache_dir": str(tmp_path / "cache")},
        "model": {**tiny_model(num_layers=2, seq_len=64, gradient_checkpointing=False), **(model or {})},
        "trainer": {
            "num_train_steps": 30,
            "train_batch_size": 8,
            "steps_per_eval": 15,
            "max_eval_batches": 2,
            "log_dir": str(tmp_path / "logs"),
            "id": "tiny",
            "checkpointer": {"base_path": str(tmp_path / "ckpt"), "keep": [{"every": 10}]},
            **trainer,
        },
        "optimizer": {
            "learning_rate": 1e-2,
            "warmup": 0,
            "lr_schedule": "constant",
            "weight_decay": 0.0,
            **(optimizer or {}),
        },
    }
    return validate_train_config(raw, Sources("test"))


def test_gradient_accumulation_gives_the_full_batch_gradients(tmp_path):
    config = tiny_config(tmp_path)
    Vocab = hax.Axis("vocab", 100)
    model = config.model.build(Vocab, key=jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 64), 0, 100)
    mesh = make_mesh(config.trainer)
    grads = {}
    for per_device in (-1, 2):
        trainer_cfg = config.trainer.model_copy(update={"per_device_parallelism": per_device})
        trainer = Trainer(trainer_cfg, None, lm_loss_and_metrics, mesh=mesh)
        assert trainer.plan.num_microbatches == (1 if per_device == -1 else 4)
        batch = hax.named(tokens, (trainer.Batch, config.model.Pos))
        (loss, _), g = jax.jit(trainer._loss_and_grad)(model, batch, jax.random.PRNGKey(2))
        grads[per_device] = (loss, trainable(g))
    (l1, g1), (l4, g4) = grads[-1], grads[2]
    np.testing.assert_allclose(l1, l4, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def test_batch_that_does_not_split_into_microbatches_is_a_config_error(tmp_path):
    from levanter_core.errors import ConfigError

    config = tiny_config(tmp_path, per_device_parallelism=3)
    with pytest.raises(ConfigError, match="per_device_parallelism"):
        Trainer(config.trainer, None, lm_loss_and_metrics, mesh=make_mesh(config.trainer))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The 30-step run of :func:`tiny_config`, trained once for this module: its directory (data
    cache, logs, checkpoints at steps 10, 20 and 30) and its result. A test that changes it
    works on a copy."""
    tmp_path = tmp_path_factory.mktemp("full-run")
    return tmp_path, run_training(tiny_config(tmp_path), config_path="tiny.yaml", progress=False)


def test_short_run_loss_falls_and_writes_the_run_directory(full_run):
    tmp_path, result = full_run
    run_dir = tmp_path / "logs" / "tiny"
    assert result.run_dir == str(run_dir)
    metrics = read_metrics(run_dir)
    train = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in train] == list(range(1, 31))
    assert train[-1]["train/loss"] < 0.8 * train[0]["train/loss"]
    assert all("optim/learning_rate" in m for m in train)
    assert all("throughput/tokens_per_second" in m for m in train[1:])
    evals = {m["step"]: m["eval/loss"] for m in metrics if "eval/loss" in m}
    assert sorted(evals) == [0, 15, 30] and evals[30] < evals[0]
    for name in ("config.yaml", "run.json", "requirements.txt", "summary.json"):
        assert (run_dir / name).exists(), name
    assert sorted(os.listdir(tmp_path / "ckpt" / "tiny")) == ["step-10", "step-20", "step-30"]
    assert result.checkpoint.endswith("step-30")


def test_logged_learning_rate_and_throughput_of_evaluation_steps(tmp_path):
    """Each step logs the schedule's learning rate, and a step that also evaluates logs the
    step's own throughput. (Evaluating the schedule on the device each step used to make the
    loop wait for the step after the logged one, so an evaluation step's time came out near 0.)"""
    config = tiny_config(
        tmp_path,
        model={"hidden_dim": 256, "seq_len": 128},  # steps long enough to time
        optimizer={"lr_schedule": "cosine", "warmup": 2},
        num_train_steps=8,
        steps_per_eval=4,
        train_batch_size=16,
    )
    run_training(config, config_path="tiny.yaml", progress=False)
    train = [m for m in read_metrics(tmp_path / "logs" / "tiny") if "train/loss" in m]
    schedule = config.optimizer.lr_scheduler(8)
    np.testing.assert_allclose([m["optim/learning_rate"] for m in train], [schedule(s) for s in range(8)], rtol=1e-6)
    rate = {m["step"]: m["throughput/tokens_per_second"] for m in train if m["step"] > 1}
    typical = float(np.median([r for step, r in rate.items() if step not in (4, 8)]))
    for step in (4, 8):  # wide bounds for busy machines; the bug was off by over 100x
        assert typical / 5 < rate[step] < 5 * typical, (step, rate)


def test_rerunning_resumes_from_the_latest_checkpoint_and_continues_identically(tmp_path, full_run):
    shutil.copytree(full_run[0], tmp_path, dirs_exist_ok=True)  # the uninterrupted run, here
    config = tiny_config(tmp_path)
    run_dir = tmp_path / "logs" / "tiny"
    full = {m["step"]: m for m in read_metrics(run_dir) if "train/loss" in m}

    # Lose everything after step 10, as if the run had been killed there.
    for step in (20, 30):
        shutil.rmtree(tmp_path / "ckpt" / "tiny" / f"step-{step}")
    result = run_training(config, progress=False)
    assert result.start_step == 10 and result.final_step == 30

    again = [m for m in read_metrics(run_dir) if "train/loss" in m]
    assert [m["step"] for m in again] == list(range(1, 31))  # each step once
    for m in again[10:]:
        assert m["train/loss"] == pytest.approx(full[m["step"]]["train/loss"], rel=1e-5)

    # A finished run re-run does nothing more.
    assert run_training(config, progress=False).final_step == 30


def test_mixed_precision_keeps_parameters_in_float32_and_trains(tmp_path):
    config = tiny_config(tmp_path, mp="p=f32,c=bfloat16", num_train_steps=5, steps_per_eval=5)
    result = run_training(config, progress=False)
    assert result.last_loss < result.first_loss
    from levanter_core.checkpoint import read_metadata

    meta = read_metadata(result.checkpoint)
    dtypes = {leaf["name"]: leaf["dtype"] for leaf in meta["leaves"]}
    assert dtypes["model/embeddings/token_embeddings/weight"] == "float32"


def test_a_nan_loss_stops_the_run(tmp_path):
    from levanter_core.trainer.trainer import NonFiniteLossError

    config = tiny_config(tmp_path, num_train_steps=20, steps_per_eval=100)
    config = config.model_copy(update={"optimizer": config.optimizer.model_copy(update={"learning_rate": 1e38})})
    with pytest.raises(NonFiniteLossError, match="NaN at step"):
        run_training(config, progress=False)
