"""The sampler draws from the distribution it is asked for: temperature, top-k, top-p."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from levanter_core.inference.sampling import choose_tokens, token_keys, top_tokens

LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15], np.float32))
DRAWS = 40_000


def frequencies(temperature=1.0, top_k=0, top_p=1.0, logits=LOGITS) -> np.ndarray:
    rows = DRAWS
    keys = token_keys(jnp.full(rows, 7, jnp.uint32), jnp.zeros(rows, jnp.int32), jnp.arange(rows))
    tokens, logprobs = jax.jit(choose_tokens)(
        jnp.tile(jnp.asarray(logits), (rows, 1)),
        jnp.full(rows, temperature, jnp.float32),
        jnp.full(rows, top_k, jnp.int32),
        jnp.full(rows, top_p, jnp.float32),
        keys,
    )
    tokens = np.asarray(tokens)
    # the log-probability reported is the model's, whatever the temperature or truncation
    np.testing.assert_allclose(np.asarray(logprobs), jax.nn.log_softmax(logits)[tokens], atol=1e-6)
    return np.bincount(tokens, minlength=len(logits)) / rows


def expected(probs: np.ndarray) -> np.ndarray:
    return probs / probs.sum()


def test_plain_sampling_follows_the_model():
    np.testing.assert_allclose(frequencies(), np.exp(LOGITS), atol=0.01)


def test_temperature_sharpens_and_flattens():
    for t in (0.5, 2.0):
        np.testing.assert_allclose(frequencies(temperature=t), expected(np.exp(LOGITS / t)), atol=0.01)


def test_top_k_and_top_p_keep_the_likeliest():
    top2 = np.array([0, 0.4, 0, 0.3, 0])
    np.testing.assert_allclose(frequencies(top_k=2), expected(top2), atol=0.01)
    # 0.4 + 0.3 = 0.7 < 0.75: the nucleus of 0.75 needs the third likeliest too
    np.testing.assert_allclose(frequencies(top_p=0.75), expected(top2 + [0, 0, 0, 0, 0.15]), atol=0.01)
    np.testing.assert_allclose(frequencies(top_p=0.7), expected(top2), atol=0.01)


def test_zero_probability_tokens_are_never_drawn():
    logits = np.array([-np.inf, 0.0, -np.inf, -np.inf, 0.0, -np.inf], np.float32)
    freq = frequencies(logits=logits)
    assert freq[[0, 2, 3, 5]].sum() == 0
    assert freq[1] == pytest.approx(0.5, abs=0.01)


def test_greedy_rows_beside_sampled_rows():
    logits = jnp.tile(jnp.asarray(LOGITS), (4, 1))
    keys = token_keys(jnp.arange(4, dtype=jnp.uint32), jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32))
    temperature = jnp.array([0.0, 1.0, 0.0, 1.0])
    tokens, _ = choose_tokens(logits, temperature, jnp.zeros(4, jnp.int32), jnp.ones(4), keys)
    assert tokens[0] == tokens[2] == 1  # the likeliest


def test_top_tokens():
    ids, logprobs = top_tokens(jnp.asarray(LOGITS)[None], 3)
    assert ids.tolist() == [[1, 3, 4]]
    np.testing.assert_allclose(np.exp(logprobs), [[0.4, 0.3, 0.15]], rtol=1e-5)
