"""The Hyena operator against a direct computation (its FFT convolution against an explicit
causal convolution, the whole operator with that convolution in place of the FFT), its
causality, Levanter's config, and training from the nano config (through
:class:`~levanter_core.testing.model_family.NanoTrainingTests`)."""

import os

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from haliax import Axis

from levanter_core.config.base import validate_section
from levanter_core.models.lm import lm_loss_and_metrics
from levanter_core.testing.model_family import NanoTrainingTests
from levanter_model_gpt2 import hyena
from levanter_model_gpt2.hyena import Gpt2HyenaConfig, HyenaConfig, HyenaOperator, causal_fft_convolution

LEVANTER_CONFIG = os.path.join(
    os.path.dirname(__file__), *[".."] * 4, "..", "shared", "levanter-configs", "config", "gpt2_hyena_nano.yaml"
)

Pos = Axis("position", 48)


def direct_causal_convolution(u, h, Pos):
    """``y[t] = sum_{s <= t} h[t - s] u[s]``, one output at a time, as a Toeplitz matrix product."""
    n = Pos.size
    lag = np.arange(n)[:, None] - np.arange(n)[None, :]  # t - s
    h = h.broadcast_to(u.axes).rearrange((..., Pos.name)).array
    u_arr = u.rearrange((..., Pos.name)).array
    taps = jnp.where(lag >= 0, jnp.take(h, np.clip(lag, 0, n - 1), axis=-1), 0.0)  # [..., t, s]
    y = jnp.einsum("...ts,...s->...t", taps, u_arr)
    return hax.named(y, u.rearrange((..., Pos.name)).axes).rearrange(u.axes)


@eqx.filter_jit
def forward(model, ids):
    """The logits of ``ids`` [batch, position], compiled: the two tests that run the 2-layer model
    on two rows of Pos tokens share one program."""
    return model(hax.named(ids, ("batch", "position"))).array


def test_fft_convolution_is_the_causal_convolution():
    u = hax.random.normal(jax.random.PRNGKey(0), (Axis("batch", 2), Pos, Axis("head_size", 5)))
    h = hax.random.normal(jax.random.PRNGKey(1), (Pos, Axis("head_size", 5)))
    direct = direct_causal_convolution(u, h, Pos).array
    np.testing.assert_allclose(causal_fft_convolution(u, h, Pos).array, direct, atol=1e-5)


@pytest.mark.parametrize(
    "settings", [{}, {"order": 3, "num_heads": 2}, {"num_blocks": 2, "short_filter_order": 4}, {"outer_mixing": True}]
)
def test_operator_equals_the_direct_long_convolution(settings, monkeypatch):
    config = HyenaConfig(seq_len=Pos.size, hidden_dim=16, filter_order=8, **settings)
    op = HyenaOperator.init(config, key=jax.random.PRNGKey(2), std=0.3)
    u = hax.random.normal(jax.random.PRNGKey(3), (Axis("batch", 2), Pos, config.Embed))
    ours = op(u).array
    monkeypatch.setattr(hyena, "causal_fft_convolution", direct_causal_convolution)
    direct = op(u).array
    np.testing.assert_allclose(ours, direct, atol=1e-5)
    assert np.abs(ours).max() > 1e-3


def test_outputs_do_not_depend_on_later_inputs():
    config = Gpt2HyenaConfig(num_layers=2, hyena=HyenaConfig(seq_len=Pos.size, hidden_dim=16, filter_order=8))
    model = config.build(Axis("vocab", 30), key=jax.random.PRNGKey(4))
    ids = jax.random.randint(jax.random.PRNGKey(5), (2, Pos.size), 0, 30)
    changed = ids.at[:, 20:].set((ids[:, 20:] + 7) % 30)
    before, after = (forward(model, x) for x in (ids, changed))
    np.testing.assert_allclose(before[:, :20], after[:, :20], atol=1e-5)
    assert np.abs(before[:, 20:] - after[:, 20:]).max() > 1e-4


def _loss_and_grads(**changes):
    hyena_config = HyenaConfig(seq_len=Pos.size, hidden_dim=16, filter_order=8)
    model = Gpt2HyenaConfig(num_layers=2, hyena=hyena_config, **changes).build(
        Axis("vocab", 30), key=jax.random.PRNGKey(6)
    )
    ids = hax.named(jax.random.randint(jax.random.PRNGKey(7), (2, Pos.size), 0, 30), ("batch", "position"))
    # compiled as one program (run eagerly, op by op, each variant cost about twice the CPU)
    loss_and_grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: lm_loss_and_metrics(m, ids), has_aux=True))
    (loss, _), grads = loss_and_grads(model)
    # the embeddings' gradients are laid out alike whether the blocks are stacked or not
    return float(loss), grads.embeddings.token_embeddings.weight.array


@pytest.fixture(scope="module")
def default_loss_and_grads():
    """The default blocks' (stacked, checkpointed) loss and gradients: computed once, the
    reference of every variant below."""
    return _loss_and_grads()


@pytest.mark.parametrize("fields", [{"gradient_checkpointing": False}, {"scan_layers": False}])
def test_checkpointed_and_unrolled_blocks_give_the_same_loss_and_gradients(fields, default_loss_and_grads):
    loss, grads = default_loss_and_grads
    other_loss, other_grads = _loss_and_grads(**fields)
    assert other_loss == pytest.approx(loss, abs=1e-6)
    np.testing.assert_allclose(other_grads, grads, atol=1e-6)


@pytest.mark.skipif(not os.path.exists(LEVANTER_CONFIG), reason="Levanter's configs are not beside the repository")
def test_levanters_config_loads_with_its_meaning():
    with open(LEVANTER_CONFIG) as f:
        section = yaml.safe_load(f)["model"]
    config = validate_section("model", section)
    assert isinstance(config, Gpt2HyenaConfig)
    assert (config.num_layers, config.hyena.hidden_dim, config.hyena.filter_order) == (2, 32, 16)
    assert config.seq_len == config.hyena.seq_len == 1024  # Levanter's default length


def test_packed_examples_are_refused():
    from levanter_core.layers import AttentionMask

    config = Gpt2HyenaConfig(num_layers=1, hyena=HyenaConfig(seq_len=16, hidden_dim=8, filter_order=4))
    model = config.build(Axis("vocab", 30), key=jax.random.PRNGKey(0))
    ids = hax.named(jnp.zeros((1, 16), jnp.int32), ("batch", "position"))
    mask = AttentionMask.causal_mask().with_segments(hax.named(jnp.zeros((1, 16), jnp.int32), ("batch", "position")))
    with pytest.raises(ValueError, match="cannot train on packed examples"):
        model.activations(ids, attn_mask=mask)


class TestHyenaNano(NanoTrainingTests):
    package = "levanter_model_gpt2"
    nano_configs = ("gpt2_hyena_nano.yaml",)
    golden_losses = "assets/losses"  # the 20-step loss curve of each (levanter_core.testing.golden)


def test_decodes_without_a_cache_as_its_own_greedy_argmax(caplog):
    # Hyena has no key/value cache: the engine runs it over the sequence so far at every step
    from levanter_core.inference.engine import Engine
    from levanter_core.inference.sampling import SamplingParams

    config = Gpt2HyenaConfig(num_layers=2, hyena=HyenaConfig(seq_len=Pos.size, hidden_dim=16, filter_order=8))
    model = config.build(Axis("vocab", 30), key=jax.random.PRNGKey(4))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    with Engine(model, max_seqs=2, max_rounds=2) as engine:
        ours = [c[0].tokens for c in engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0))]
    assert "has no key/value cache" in caplog.text
    # The reference: one compiled forward pass over all Pos positions, both sequences at once,
    # read at each one's last token (the causality test's program, where running the model
    # eagerly on each length's prefix cost ~25 CPU-s more, of per-shape compiles). That reads
    # the same argmax as the prefix alone because this model is causal (test_outputs_do_not_depend_on_later_inputs,
    # on this very model); the padding is not the engine's (zeros), so a decoding that let later
    # positions leak in would not agree with it.
    expected = [list(prompt) for prompt in prompts]
    for _ in range(6):
        ids = np.array([(np.arange(Pos.size) * 7 + 3) % 30] * len(prompts), np.int32)
        for row, sequence in enumerate(expected):
            ids[row, : len(sequence)] = sequence
        logits = np.asarray(forward(model, jnp.asarray(ids)))
        for row, sequence in enumerate(expected):
            sequence.append(int(np.argmax(logits[row, len(sequence) - 1])))
    assert ours == [sequence[len(prompt) :] for prompt, sequence in zip(prompts, expected)]
