"""What several of these tests share: a few optimizer steps on a tiny GPT-2, and the error a
bad ``optimizer:`` section gives when a run's config is validated."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import pytest

from levanter_core.errors import ConfigError
from levanter_core.models.lm import next_token_loss


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
