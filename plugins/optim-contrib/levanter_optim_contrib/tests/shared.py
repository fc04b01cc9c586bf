"""What several of these tests share: optimizer steps on given gradients and on a tiny GPT-2,
Newton-Schulz as numpy computes it, and the error a bad ``optimizer:`` section gives when a
run's config is validated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import optax
import pytest

from levanter_core.errors import ConfigError
from levanter_core.models.lm import next_token_loss
from levanter_optim_contrib.orthogonalize import NS_COEFFICIENTS


def apply_steps(optimizer, params, grads: list, record: Callable[[Any], Any]) -> tuple[list, Any]:
    """Apply ``optimizer`` (jitted) with each of ``grads`` in turn, from ``params``; what
    ``record`` makes of the parameters after each step, and the final state."""
    update = jax.jit(optimizer.update)
    state = optimizer.init(params)
    history = []
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        history.append(record(params))
    return history, state


def newton_schulz_reference(matrix: np.ndarray, steps: int, eps: float = 1e-8) -> np.ndarray:
    """Newton-Schulz as it acts on the singular values, in float64: ``U p(S / |G|_F) V^T`` with
    ``p`` the quintic (Keller Jordan's coefficients) applied ``steps`` times."""
    m = np.asarray(matrix, np.float64)
    u, s, vt = np.linalg.svd(m, full_matrices=False)
    s = s / (np.linalg.norm(m) + eps)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return (u * s) @ vt


def losses_of(optimizer, model, *, steps: int, vocab: int = 64, seed: int = 1) -> list[float]:
    """The loss before each of ``steps`` steps of ``optimizer`` (an optax transformation, as
    ``build_for_trainer`` makes it) on one fixed batch of 4 random rows of 16 tokens. Checks
    that the optimizer's state holds only arrays (what a checkpoint can store)."""
    ids = jax.random.randint(jax.random.PRNGKey(seed), (4, 16), 0, vocab)
    tokens = hax.named(ids, ("batch", "position"))
    state = optimizer.init(model)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(lambda m: next_token_loss(m, tokens))(model)
        updates, state = optimizer.update(grads, state, model, loss=loss)
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(steps):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    return losses


def assert_refused(tmp_path, section: dict, message: str) -> None:
    """Validating a run whose ``optimizer:`` is ``section`` raises a ConfigError matching
    ``message`` (a regular expression), as ``levanter train`` would report it."""
    from levanter_core.config.loader import Sources
    from levanter_core.config.train import validate_train_config

    raw = {
        "data": {"type": "python_stdlib", "tokenizer": "byte", "cache_dir": str(tmp_path)},
        "model": {"type": "gpt2"},
        "optimizer": section,
    }
    with pytest.raises(ConfigError, match=message):
        validate_train_config(raw, Sources("run.yaml"))
