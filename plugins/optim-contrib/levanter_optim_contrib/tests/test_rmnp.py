"""RMNP (``type: rmnp``), the optimizer of Levanter's current ``gpt2_small_fast_rmnp.yaml``:
its update checked against the equations of Levanter's ``optim/rmnp.py``, in float64."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
import yaml

from levanter_core.config.train import load_train_config
from levanter_core.plugins import registry
from levanter_optim_contrib.rmnp import row_normalized
from levanter_optim_contrib.tests.shared import losses_of
from levanter_optim_contrib.tests.test_muon import Vocab, as_plain, assert_close, gpt2, random_like, tiny


def rmnp_config(**fields):
    return registry("optimizer").get("rmnp").config_cls.model_validate(fields)


def rows_normalized(matrix: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Each row (an output unit's weights over the inputs) divided by its norm, in float64."""
    norms = np.linalg.norm(matrix, axis=-1, keepdims=True)
    return matrix / np.maximum(norms, eps)


@pytest.mark.parametrize(("shape", "kimi"), [((10, 6), False), ((6, 10), False), ((3, 4, 9), True)])
def test_each_row_is_scaled_to_unit_norm_then_by_the_shape(shape, kimi):
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), shape), np.float64)
    d_out, d_in = shape[-2:]
    scale = 0.2 * math.sqrt(max(d_out, d_in)) if kimi else math.sqrt(max(1, d_out / d_in))
    assert_close(row_normalized(1e-8, kimi)(jax.numpy.asarray(x, jax.numpy.float32)), rows_normalized(x) * scale)


def test_a_zero_row_stays_zero():
    x = np.zeros((3, 5), np.float32)
    x[1] = 2.0
    got = np.asarray(row_normalized(1e-8)(jax.numpy.asarray(x)))
    assert not got[0].any() and not got[2].any() and np.allclose(np.linalg.norm(got[1]), 1.0)


def test_three_steps_follow_levanters_equations():
    """B <- m B + G, M = m B + G, update = -lr (scale rownorm(M) + wd W) for the hidden matrices;
    AdamW (clipped, its own learning rate and, with adam_weight_decay, decay) for the rest."""
    lr, adam_lr, m, wd, adam_wd = 0.05, 0.01, 0.9, 0.2, 0.0
    config = rmnp_config(
        learning_rate=lr, adam_lr=adam_lr, momentum=m, weight_decay=wd, adam_weight_decay=adam_wd,
        warmup=0, lr_schedule="constant", max_grad_norm=None,
    )  # fmt: skip
    opt = config.build_for_trainer(10)
    params = tiny(jax.random.PRNGKey(3))
    state = opt.init(params)
    plain = {k: np.asarray(v, np.float64) for k, v in as_plain(params).items()}
    buf = {k: np.zeros_like(plain[k]) for k in ("qkv", "proj")}
    first = {k: np.zeros_like(v) for k, v in plain.items()}
    second = {k: np.zeros_like(v) for k, v in plain.items()}
    for step in range(1, 4):
        grads = random_like(params, jax.random.PRNGKey(20 + step))
        updates, state = jax.jit(opt.update)(grads, state, params)
        got = as_plain(updates)
        g = {k: np.asarray(v, np.float64) for k, v in as_plain(grads).items()}
        for name in ("qkv", "proj"):
            buf[name] = m * buf[name] + g[name]
            look_ahead = m * buf[name] + g[name]
            # as_plain stores each matrix (in, out): normalize the rows of the (out, in) matrix
            d_in, d_out = look_ahead.shape
            direction = rows_normalized(look_ahead.T).T * math.sqrt(max(1, d_out / d_in))
            want = -lr * (direction + wd * plain[name])
            assert_close(got[name], want, rtol=1e-5, atol=2e-7)
            plain[name] = plain[name] + want
        for name in ("embedding", "lm_head", "proj_bias", "norm"):  # AdamW's, not decayed here
            first[name] = 0.9 * first[name] + 0.1 * g[name]
            second[name] = 0.95 * second[name] + 0.05 * g[name] ** 2
            mean, var = first[name] / (1 - 0.9**step), second[name] / (1 - 0.95**step)
            assert_close(got[name], -adam_lr * mean / (np.sqrt(var) + 1e-8), rtol=1e-4, atol=1e-7)
        params = jax.tree.map(lambda p, u: p + u, params, updates)


def test_training_lowers_the_loss():
    opt = rmnp_config(learning_rate=0.02, adam_lr=0.003, warmup=0).build_for_trainer(20)
    losses = losses_of(opt, gpt2(), steps=15, vocab=Vocab.size)
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.5, losses


def test_levanters_fields_and_defaults():
    config = rmnp_config()
    assert (config.adam_lr, config.momentum, config.nesterov, config.rmnp_epsilon) == (6e-4, 0.95, True, 1e-8)
    assert (config.weight_decay, config.adam_weight_decay, config.max_grad_norm) == (0.0, None, 1.0)
    with pytest.warns(UserWarning, match="optimizer.lr .* no effect"):
        rmnp_config(lr=0.1)


def test_levanters_current_rmnp_config_loads(tmp_path):
    """The optimizer and model of Levanter's current gpt2_small_fast_rmnp.yaml (written here from
    it: its data is OpenWebText, which a test cannot read)."""
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n')
    raw = {
        "data": {"tokenizer": "byte", "train_urls": [str(tmp_path / "train.jsonl")], "cache_dir": str(tmp_path)},
        "model": {"type": "gpt2", "hidden_dim": 768, "num_heads": 12, "num_layers": 12, "max_seq_len": 1024},
        "train_seq_len": 1024,
        "trainer": {"mp": "p=f32,c=bfloat16", "train_batch_size": 256, "num_train_steps": 20000},
        "optimizer": {"type": "rmnp", "learning_rate": 3e-3, "weight_decay": 0.05},
    }
    path = tmp_path / "rmnp.yaml"
    path.write_text(yaml.safe_dump(raw))
    config, _ = load_train_config(str(path))
    assert type(config.optimizer).__name__ == "RmnpConfig"
    assert (config.optimizer.learning_rate, config.optimizer.weight_decay, config.optimizer.adam_lr) == (
        3e-3,
        0.05,
        6e-4,
    )
