import math

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from pydantic import ValidationError

import levanter_core.plugins
from levanter_core.models.lm import LmHeadModel, next_token_loss
from levanter_model_gpt2.gpt2 import Gpt2Config, Gpt2LMHeadModel

Vocab = hax.Axis("vocab", 50)
Batch = hax.Axis("batch", 2)


def tiny_config(**overrides) -> Gpt2Config:
    return Gpt2Config(hidden_dim=32, num_layers=2, num_heads=2, seq_len=16, **overrides)


def random_ids(config: Gpt2Config, seed: int = 1) -> hax.NamedArray:
    return hax.random.randint(jax.random.PRNGKey(seed), (Batch, config.Pos), 0, Vocab.size)


@eqx.filter_jit
def forward(model, input_ids, key=None):
    return model(input_ids, key=key)


@eqx.filter_jit
def loss_and_grad(model, input_ids):
    return eqx.filter_value_and_grad(next_token_loss)(model, input_ids)


def assert_trees_close(a, b, **tol):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


@pytest.fixture(scope="module")
def config():
    return tiny_config()


@pytest.fixture(scope="module")
def model(config):
    return config.build(Vocab, key=jax.random.PRNGKey(0))


def test_model_follows_the_core_protocol(model, config):
    assert isinstance(model, Gpt2LMHeadModel)
    assert isinstance(model, LmHeadModel)
    assert model.Vocab == Vocab and model.Pos == config.Pos and model.config is config
    assert set(model.get_lm_head().axes) == {config.Embed, Vocab}


def test_logits_have_named_axes_and_are_causal(model, config):
    ids = random_ids(config)
    logits = forward(model, ids)
    assert logits.axes == (Batch, config.Pos, Vocab)
    # the axes only: traced, not run (run eagerly, op by op, it cost ~3 CPU-s of compiles)
    assert eqx.filter_eval_shape(lambda m, x: m.activations(x), model, ids).axes == (Batch, config.Pos, config.Embed)

    t = 8
    changed_ids = ids.at[config.Pos, t].set((ids[config.Pos, t] + 1) % Vocab.size)
    changed = forward(model, changed_ids)
    np.testing.assert_array_equal(changed[config.Pos, :t].array, logits[config.Pos, :t].array)
    assert not np.allclose(changed[config.Pos, t:].array, logits[config.Pos, t:].array)


def test_gradient_checkpointing_changes_neither_logits_nor_gradients(config):
    ids = random_ids(config)
    key = jax.random.PRNGKey(0)
    with_remat = tiny_config(gradient_checkpointing=True).build(Vocab, key=key)
    without = tiny_config(gradient_checkpointing=False).build(Vocab, key=key)

    np.testing.assert_allclose(forward(with_remat, ids).array, forward(without, ids).array, rtol=1e-5, atol=1e-6)
    loss_a, grad_a = loss_and_grad(with_remat, ids)
    loss_b, grad_b = loss_and_grad(without, ids)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    assert_trees_close(grad_a, grad_b, rtol=1e-4, atol=1e-6)


def test_initial_loss_is_near_uniform_and_blockwise_loss_agrees(model, config):
    ids = random_ids(config)
    loss, grad = loss_and_grad(model, ids)
    assert abs(float(loss) - math.log(Vocab.size)) < 0.1

    blockwise = tiny_config(cross_entropy_block_size=16).build(Vocab, key=jax.random.PRNGKey(0))
    block_loss, block_grad = loss_and_grad(blockwise, ids)
    np.testing.assert_allclose(block_loss, loss, rtol=1e-5)
    assert_trees_close(block_grad, grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_the_jax_attention_backend_gives_the_reference_logits(config, packed):
    """``attn_backend: jax`` (what ``auto`` picks on a GPU: cuDNN's fused attention) on GPT-2's
    one-query-head-per-key-head attention, causal and over packed documents."""
    from levanter_core.layers.attention import AttentionMask

    ids = random_ids(config)
    mask = AttentionMask.causal_mask()
    if packed:
        mask = mask.with_segments(hax.named(jnp.array([[0] * 6 + [1] * 10, [0] * 16]), (Batch, config.Pos)))

    def logits(backend):
        m = config.model_copy(update={"attn_backend": backend}).build(Vocab, key=jax.random.PRNGKey(0))  # same weights
        run = eqx.filter_jit(lambda m, ids: hax.dot(m.activations(ids, attn_mask=mask), m.get_lm_head(), axis="embed"))
        return np.asarray(run(m, ids).array)

    np.testing.assert_allclose(logits("jax"), logits("reference"), atol=1e-5)


def test_dropout_only_with_a_key():
    config = tiny_config(embed_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.1)
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    ids = random_ids(config)

    inference = forward(model, ids)
    np.testing.assert_array_equal(forward(model, ids).array, inference.array)
    dropped = forward(model, ids, jax.random.PRNGKey(5))
    assert not np.allclose(dropped.array, inference.array)


def test_bfloat16_compute_stays_bfloat16_and_close_to_float32(model, config):
    ids = random_ids(config)
    for upcast in (False, True):
        same_weights = tiny_config(upcast_attn=upcast).build(Vocab, key=jax.random.PRNGKey(0))
        low = jmp.get_policy("p=f32,c=bfloat16").cast_to_compute(same_weights)
        logits = forward(low, ids)
        assert logits.dtype == jnp.bfloat16
        np.testing.assert_allclose(logits.array.astype(np.float32), forward(model, ids).array, atol=0.03)


def test_heads_must_divide_hidden_dim():
    with pytest.raises(ValidationError) as info:
        Gpt2Config(hidden_dim=30, num_heads=4)
    message = str(info.value)
    assert "30" in message and "4" in message and "divisible" in message


def test_flops_per_token_counts_every_matmul_weight(model, config):
    # Every entry of a projection matrix (stacked over layers) and of the tied LM head
    # is one multiply-add per token; attention adds 2 * seq_len * hidden per layer.
    def is_linear(x):
        return isinstance(x, hnn.Linear)

    linears = [x for x in jax.tree.leaves(model, is_leaf=is_linear) if is_linear(x)]
    projection_weights = sum(linear.weight.size for linear in linears)
    lm_head = model.get_lm_head().size
    attention = 2 * config.num_layers * config.seq_len * config.hidden_dim
    assert config.flops_per_token(Vocab.size) == 3 * 2 * (projection_weights + lm_head + attention)


def test_registered_through_its_entry_point():
    try:
        levanter_core.plugins.reset(autoload=True)
        entry = levanter_core.plugins.registry("model").get("gpt2")
        assert entry.distribution == "levanter-model-gpt2"
        assert entry.config_cls is Gpt2Config
        assert isinstance(entry.config_cls.model_validate({"type": "gpt2", "num_layers": 3}), Gpt2Config)
    finally:
        levanter_core.plugins.reset()


def test_adam_overfits_a_fixed_batch(config):
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    ids = random_ids(config, seed=3)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(next_token_loss)(model, ids)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for _ in range(20):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.25 * losses[0]
