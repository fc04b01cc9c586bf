"""PSGD Kron (``type: kron``) against the equations written plainly in numpy (float64), with
explicit Kronecker products instead of per-dimension products."""

import itertools
import math

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest

from levanter_core.models.lm import next_token_loss
from levanter_core.plugins import registry
from levanter_optim_contrib import kron
from levanter_optim_contrib.kron import KronConfig, scale_by_kron, update_probability_schedule

EPS32 = float(np.finfo(np.float32).eps)


def fixed_vector(shape):
    """A "random" vector that depends only on the number of entries."""
    size = math.prod(shape)
    return np.random.default_rng(size).standard_normal(size).reshape(shape)


def fixed_probe(key, shape):
    """Probes of shape (layers, *layer) that are the same on every step and in every layer (so a
    merged or stacked tensor gets the same ones as its unmerged or unstacked twin)."""
    return jnp.broadcast_to(jnp.asarray(fixed_vector(shape[1:]), jnp.float32), shape)


# -- the reference ---------------------------------------------------------------------------


def kron_matrix(qs):
    """Q_1 (x) ... (x) Q_n as one matrix acting on C-order flattened tensors."""
    out = np.ones((1, 1))
    for q in qs:
        out = np.kron(out, np.diag(q) if q.ndim == 1 else q)
    return out


def unfold(x, i):
    return np.moveaxis(x, i, 0).reshape(x.shape[i], -1)


def norm_lower_bound(m):
    scale = np.abs(m).max()
    m = m / scale
    x = m[:, np.argmax((m * m).sum(axis=0))] @ m
    return scale * np.linalg.norm((x / np.linalg.norm(x)) @ m.T)


def ref_refit(qs, m, v, lr, mean_abs=None):
    """One step of each Q_i on the whitening criterion; damping relative to ``mean_abs``
    (default: of ``m`` itself)."""
    mean_abs = np.abs(m).mean() if mean_abs is None else mean_abs
    h = m + np.sqrt(EPS32) * mean_abs * v
    K = kron_matrix(qs)
    A = (K @ h.ravel()).reshape(m.shape)
    B = (np.linalg.inv(K).T @ v.ravel()).reshape(m.shape)
    new = []
    for i, q in enumerate(qs):
        ga, gb = unfold(A, i) @ unfold(A, i).T, unfold(B, i) @ unfold(B, i).T
        if q.ndim == 1:
            ga, gb = np.diag(ga), np.diag(gb)
            new.append(q - lr / (ga + gb).max() * (ga - gb) * q)
        else:
            new.append(q - lr / norm_lower_bound(ga + gb) * np.triu(ga - gb) @ q)
    return new


def ref_precondition(qs, m):
    K = kron_matrix(qs)
    return (K.T @ K @ m.ravel()).reshape(m.shape)


def initial_qs(shape, diagonal, scale=1.0):
    s = scale ** (1 / len(shape))
    return [np.full(d, s) if diag else s * np.eye(d) for d, diag in zip(shape, diagonal)]


def random_grads(params, step):
    rng = np.random.default_rng(100 + step)
    return {k: jnp.asarray(rng.standard_normal(p.shape), jnp.float32) for k, p in sorted(params.items())}


def kron_only(**kw):
    options = dict(target_merged_dim_size=None, block_size=None, probe=fixed_probe, precond_update_precision="float32")
    return scale_by_kron(**{**options, **kw})


# -- the update against the reference --------------------------------------------------------


@pytest.mark.parametrize("beta1, max_size", [(0.9, 25000), (0.0, 5)], ids=["triangular", "diagonal-large-dims"])
def test_updates_match_reference(beta1, max_size):
    params = {"w": jnp.zeros((6, 5)), "t": jnp.zeros((4, 3, 2)), "b": jnp.zeros((5,))}
    lr, scale = 0.3, 2.0
    tx = kron_only(beta1=beta1, max_size_triangular=max_size, preconditioner_lr=lr, preconditioner_init_scale=scale)
    state = tx.init(params)
    update = jax.jit(tx.update)
    # dims over max_size_triangular (6 > 5), and 1-d parameters, get diagonal factors
    diagonal = {"w": (max_size < 6, False), "t": (False, False, False), "b": (True,)}
    for name, diag in diagonal.items():
        shapes = [q.shape for q in state.factors[sorted(params).index(name)][0]]
        assert shapes == [(1, d) if dg else (1, d, d) for d, dg in zip(params[name].shape, diag)]

    qs = {k: initial_qs(p.shape, diagonal[k], scale) for k, p in params.items()}
    mu = {k: np.zeros(p.shape) for k, p in params.items()}
    for step in range(1, 5):
        grads = random_grads(params, step)
        updates, state = update(grads, state, params, key=jax.random.PRNGKey(step))
        for k in params:
            g = np.asarray(grads[k], np.float64)
            mu[k] = beta1 * mu[k] + (1 - beta1) * g
            m = mu[k] / (1 - beta1**step) if beta1 else g
            qs[k] = ref_refit(qs[k], m, fixed_vector(g.shape), lr)
            expected = ref_precondition(qs[k], m)
            np.testing.assert_allclose(updates[k], expected, rtol=2e-5, atol=2e-6 * np.abs(expected).max())
            got_qs = state.factors[sorted(params).index(k)][0]
            for got, want in zip(got_qs, qs[k]):
                np.testing.assert_allclose(got[0], want, rtol=2e-5, atol=2e-6)


def test_blocks_are_preconditioned_on_their_own():
    """A (10, 6) weight in blocks of 4: rows 0-4, 4-8, 8-10 times columns 0-4, 4-6, each block
    with its own factors; the damping is relative to the whole tensor's mean."""
    params = {"w": jnp.zeros((10, 6))}
    tx = kron_only(beta1=0.0, block_size=4)
    state = tx.init(params)
    rows, cols = [(0, 4), (4, 8), (8, 10)], [(0, 4), (4, 6)]
    qs = {(r, c): initial_qs((r[1] - r[0], c[1] - c[0]), (False, False)) for r in rows for c in cols}
    v = fixed_vector((10, 6))
    for step in range(1, 4):
        grads = random_grads(params, step)
        updates, state = jax.jit(tx.update)(grads, state, params, key=jax.random.PRNGKey(0))
        g = np.asarray(grads["w"], np.float64)
        expected = np.zeros_like(g)
        for (r, c), q in qs.items():
            block = (slice(*r), slice(*c))
            qs[r, c] = ref_refit(q, g[block], v[block], 0.1, mean_abs=np.abs(g).mean())
            expected[block] = ref_precondition(qs[r, c], g[block])
        np.testing.assert_allclose(updates["w"], expected, rtol=2e-5, atol=2e-6)
    # factors stacked by block shape: 2 blocks 4x4, 2 blocks 4x2, one 2x4, one 2x2
    assert [tuple(q.shape for q in group) for group in state.factors[0]] == [
        ((2, 4, 4), (2, 4, 4)),
        ((2, 4, 4), (2, 2, 2)),
        ((1, 2, 2), (1, 4, 4)),
        ((1, 2, 2), (1, 2, 2)),
    ]


def test_merged_dims_precondition_the_reshaped_tensor():
    assert kron._merge_dims((4, 2, 8), (False,) * 3, 8) == ((8, 8), (False, False))
    # a GPT-2-small attention weight (heads, head_size, embed): heads x head_size merge
    assert kron._merge_dims((12, 64, 768), (False,) * 3, 8192) == ((768, 768), (False, False))
    assert kron._merge_dims((1, 1), (True, True), 8192) == ((1,), (True,))

    merged, plain = kron_only(target_merged_dim_size=8), kron_only()
    g = random_grads({"w": jnp.zeros((4, 2, 8))}, 0)
    s1, s2 = merged.init(g), plain.init({"w": g["w"].reshape(8, 8)})
    for step in range(3):
        u1, s1 = jax.jit(merged.update)(g, s1, key=jax.random.PRNGKey(step))
        u2, s2 = jax.jit(plain.update)({"w": g["w"].reshape(8, 8)}, s2, key=jax.random.PRNGKey(step))
        np.testing.assert_allclose(u1["w"].reshape(8, 8), u2["w"], rtol=1e-6, atol=1e-7)


def test_memory_save_modes_choose_diagonal_factors():
    def shapes(mode):
        state = kron_only(memory_save_mode=mode).init({"t": jnp.zeros((4, 3, 5))})
        return [q.shape[1:] for q in state.factors[0][0]]

    assert shapes(None) == [(4, 4), (3, 3), (5, 5)]
    assert shapes("one_diag") == [(4, 4), (3, 3), (5,)]  # the largest dimension
    assert shapes("all_diag") == [(4,), (3,), (5,)]


def test_balancing_keeps_the_preconditioner():
    rng = np.random.default_rng(0)
    qs = (jnp.asarray(np.triu(rng.standard_normal((3, 3))) * 50), jnp.asarray(rng.random(4) * 0.01 + 0.01))
    balanced = kron._balance(qs)
    np.testing.assert_allclose(float(jnp.abs(balanced[0]).max()), float(jnp.abs(balanced[1]).max()), rtol=1e-5)
    g = rng.standard_normal((3, 4))
    np.testing.assert_allclose(
        ref_precondition([np.asarray(q, np.float64) for q in balanced], g),
        ref_precondition([np.asarray(q, np.float64) for q in qs], g),
        rtol=1e-4,
    )


def test_both_triangular_solves_agree():
    """The backend's solve (GPU, TPU) and the loop used on CPU both give Q^-T b."""
    rng = np.random.default_rng(1)
    q = np.triu(rng.standard_normal((5, 5))) + 3 * np.eye(5)
    b = rng.standard_normal((5, 3))
    want = np.linalg.solve(q.T, b)
    for solve in (kron._blas_solve, kron._substitution_solve):
        got = jax.jit(solve)(jnp.asarray(q, jnp.float32), jnp.asarray(b, jnp.float32))
        np.testing.assert_allclose(got, want, rtol=1e-5)


# -- when the preconditioner is refitted, and randomness ---------------------------------------


def test_update_probability_schedule():
    schedule = update_probability_schedule(0.05, flat_start=500)
    values = [float(schedule(n)) for n in (1, 500, 1000, 1500, 2000, 4000, 10_000)]
    np.testing.assert_allclose(values, [1, 1, math.exp(-0.5), math.exp(-1), math.exp(-1.5), 0.05, 0.05], rtol=1e-6)
    config = KronConfig(preconditioner_update_probability=0.05)
    assert config.update_prob_flat_start == 500


def run_steps(tx, params, state, start, steps, keys=True):
    def one(state, step):
        grads = random_grads(params, 0)
        key = jax.random.fold_in(jax.random.PRNGKey(7), step) if keys else None
        updates, state = tx.update(grads, state, params, key=key)
        return state, updates["w"]

    return jax.lax.scan(one, state, start + jnp.arange(steps))


def test_refits_happen_with_the_scheduled_probability_and_repeat():
    params = {"w": jnp.zeros((3, 2))}
    tx = kron_only(update_probability=0.25)
    run = jax.jit(lambda s: run_steps(tx, params, s, 0, 200))
    state, _ = run(tx.init(params))
    refits = int(state.balance_count)  # refits since the last rebalancing, every 100
    assert 30 <= refits <= 70  # binomial(200, 1/4): mean 50, sd 6
    again, _ = run(tx.init(params))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), state, again))


def test_without_a_key_the_state_key_resumes_the_same_draws():
    params = {"w": jnp.zeros((3, 2))}
    tx = scale_by_kron(update_probability=0.5, target_merged_dim_size=None, block_size=None)
    three_steps = jax.jit(lambda state, start: run_steps(tx, params, state, start, 3, keys=False))
    state, first = three_steps(tx.init(params), 0)
    _, second = three_steps(state, 3)
    want = np.concatenate([first, second])
    state, got_first = three_steps(tx.init(params), 0)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
    state = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state)  # as a checkpoint restores it
    _, got_second = three_steps(state, 3)
    np.testing.assert_array_equal(np.concatenate([got_first, got_second]), want)
    assert len({np.asarray(u).tobytes() for u in want}) > 1  # the preconditioner was refitted
    assert not np.array_equal(state.key, tx.init(params).key)  # and the key moves on


# -- on a model --------------------------------------------------------------------------------


Gpt2 = registry("model").get("gpt2").config_cls
SMALL = dict(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16, use_bias=False)  # fewer arrays: faster compiles


def tiny_gpt2(**kw):
    return Gpt2(**SMALL, **kw).build(hax.Axis("vocab", 64), key=jax.random.PRNGKey(0))


def tokens(seed=0):
    ids = np.random.default_rng(seed).integers(0, 64, (4, 16))
    return hax.named(jnp.asarray(ids, jnp.int32), ("batch", "position"))


def unstacked(blocks, template):
    """Stacked GPT-2 blocks (parameters or gradients) as the unrolled ``template``'s blocks."""
    layers = [jax.tree.map(lambda x, i=i: x["layers", i], blocks.stacked, is_leaf=hax.is_named_array) for i in range(2)]
    return eqx.tree_at(lambda b: b.blocks, template, layers)


def test_stacked_layers_are_preconditioned_per_layer(monkeypatch):
    """The blocks of a GPT-2 (stacked along ``layers``) get the same updates as the same blocks
    unrolled, with per-layer gradient normalization, damping and RMS clipping."""
    monkeypatch.setattr(kron, "_normal_probe", fixed_probe)
    model = tiny_gpt2()
    stacked = model.transformer.blocks
    flat = unstacked(stacked, tiny_gpt2(scan_layers=False).transformer.blocks)
    tx = KronConfig(learning_rate=0.01, warmup=0, block_size=16, normalize_grads=True).build(10)
    grad_fn = eqx.filter_jit(eqx.filter_grad(next_token_loss))
    stacked_grads = [grad_fn(model, tokens(step)).transformer.blocks for step in range(2)]
    results = []
    for params in (stacked, flat):
        state = tx.init(params)
        for step, grads in enumerate(stacked_grads):
            grads = grads if params is stacked else unstacked(grads, flat)
            updates, state = jax.jit(tx.update)(grads, state, params, key=jax.random.PRNGKey(step))
        results.append(updates)
    assert len(jax.tree.leaves(results[0].stacked.mlp)) == 2  # c_fc and c_proj
    for a, b in zip(jax.tree.leaves(unstacked(results[0], flat)), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_training_lowers_the_loss():
    model = tiny_gpt2()
    batch = tokens()
    # merge_small_dims would merge this model's tiny matrices into vectors, whose dense
    # preconditioners take far more than 20 steps to learn
    tx = KronConfig(learning_rate=0.01, warmup=0, update_prob_flat_start=5, merge_small_dims=False).build(20)
    loss_fn = lambda m: next_token_loss(m, batch)

    @jax.jit
    def step(model, state, key):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, state = tx.update(grads, state, model, key=key)
        return eqx.apply_updates(model, updates), state, loss

    state = tx.init(model)
    losses = []
    for i in range(20):
        model, state, loss = step(model, state, jax.random.PRNGKey(i))
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.25 and all(b < a for a, b in itertools.pairwise(losses)), losses


# -- the config --------------------------------------------------------------------------------


def test_levanter_config_loads():
    levanter = {
        "type": "kron",
        "learning_rate": 3e-4,
        "beta1": 0.95,
        "weight_decay": 0.05,
        "max_grad_norm": None,
        "normalize_grads": True,
        "preconditioner_update_probability": 0.1,
        "update_prob_flat_start": 1000,
        "max_size_triangular": 8192,
        "min_ndim_triangular": 2,
        "memory_save_mode": "one_diag",
        "preconditioner_lr": 0.2,
        "preconditioner_init_scale": 1.0,
        "mu_dtype": "bfloat16",
        "precond_dtype": "float32",
        "precond_update_precision": "float32",
        "precond_grads_precision": None,
        "lax_map_scanned_layers": True,
        "lax_map_batch_size": 4,
        "merge_small_dims": False,
        "target_merged_dim_size": 2048,
        "partition_grads_into_blocks": True,
        "block_size": 128,
        "params_sharding": None,
        "preconditioner_sharding": None,
    }
    config = registry("optimizer").get("kron").config_cls.model_validate(levanter)
    assert isinstance(config, KronConfig)
    assert config.model_dump(include=set(levanter) - {"type"}) == {k: v for k, v in levanter.items() if k != "type"}
    defaults = KronConfig()
    assert (defaults.beta1, defaults.max_size_triangular, defaults.block_size, defaults.target_merged_dim_size) == (
        0.9,
        25000,
        256,
        8192,
    )
    # the lax.map path and bfloat16 momentum run
    params = {"w": jnp.ones((300, 5)), "b": jnp.ones(5)}
    tx = config.build(10)
    updates, state = jax.jit(tx.update)(params, tx.init(params), params, key=jax.random.PRNGKey(0))
    assert state[0].mu["w"].dtype == jnp.bfloat16 and bool(jnp.isfinite(updates["w"]).all())


@pytest.mark.parametrize(
    "field, value",
    [
        ("memory_save_mode", "two_diag"),
        ("preconditioner_update_probability", 0.0),
        ("preconditioner_update_probability", 1.5),
        ("block_size", 0),
        ("max_size_triangular", -1),
        ("beta1", 1.0),
        ("mu_dtype", "int8"),
        ("precond_dtype", "floaty"),
        ("precond_update_precision", "float64"),
        ("preconditioner_sharding", ["data", None]),
    ],
)
def test_bad_values_are_refused(field, value):
    with pytest.raises(pydantic.ValidationError, match=field):
        KronConfig.model_validate({field: value})
