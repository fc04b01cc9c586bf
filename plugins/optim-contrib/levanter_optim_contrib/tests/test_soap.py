"""SOAP: the updates against the paper's algorithm written out in numpy (float64), how tensors
are cut (max_precond_dim, blocks, merged dimensions, stacked layers), the config, and training
a tiny GPT-2 through the real trainer."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from pydantic import ValidationError

from levanter_optim_contrib.soap import ScaleBySoapState, SoapConfig, merged_shape


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    """On CPU, JAX's eigh and qr run in scipy's OpenBLAS, called from XLA's own threads; with
    OpenBLAS threads of its own on top, a busy machine runs them several (up to 30) times slower. (The
    library is loaded by the first decomposition, so one runs before the limit is set.)"""
    jnp.linalg.eigh(jnp.eye(2)).eigenvalues.block_until_ready()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # not installed: slower, not wrong
        yield
        return
    with threadpool_limits(1, user_api="blas"):
        yield


B1, B2, SHAMPOO_BETA, EPS = 0.9, 0.95, 0.8, 1e-8
# learning rate 1 and no clipping: the updates are minus SOAP's direction
PLAIN = dict(
    learning_rate=1.0,
    warmup=0,
    lr_schedule="constant",
    max_grad_norm=None,
    beta1=B1,
    beta2=B2,
    shampoo_beta=SHAMPOO_BETA,
    epsilon=EPS,
)


# -- the paper's algorithm, for one matrix ---------------------------------------------------------


def _eigenvectors(p):
    _, vectors = np.linalg.eigh(p)
    return vectors[:, ::-1]  # by decreasing eigenvalue


def _power_iteration(p, q, v, axis):
    """Algorithm 4: sort the basis (and V) by the estimated eigenvalues, one power step, QR."""
    order = np.argsort(-np.diag(q.T @ p @ q), kind="stable")
    q, v = q[:, order], np.take(v, order, axis=axis)
    return np.linalg.qr(p @ q)[0], v


class PaperSoap:
    """SOAP (Vyas et al. 2024, Algorithm 3) on one matrix, in float64: Adam on G rotated into the
    eigenbases Q_L, Q_R of Shampoo's L = E[G G^T], R = E[G^T G]. A side that is not
    preconditioned keeps the identity. The first call only sets L, R and their eigenvectors."""

    def __init__(self, shape, frequency, left=True, right=True):
        m, n = shape
        self.frequency, self.left, self.right = frequency, left, right
        self.L, self.R = np.zeros((m, m)), np.zeros((n, n))
        self.QL, self.QR = np.eye(m), np.eye(n)
        self.M, self.V = np.zeros(shape), np.zeros(shape)
        self.t = None

    def step(self, G):
        G = np.asarray(G, np.float64)
        if self.t is None:
            self._statistics(G)
            self.QL = _eigenvectors(self.L) if self.left else self.QL
            self.QR = _eigenvectors(self.R) if self.right else self.QR
            self.t = 0
            return np.zeros_like(G)
        self.t += 1
        rotated = self.QL.T @ G @ self.QR
        self.M = B1 * self.M + (1 - B1) * G
        self.V = B2 * self.V + (1 - B2) * rotated**2
        N = self.QL @ ((self.QL.T @ self.M @ self.QR) / (np.sqrt(self.V) + EPS)) @ self.QR.T
        N *= np.sqrt(1 - B2**self.t) / (1 - B1**self.t)
        self._statistics(G)
        if self.t % self.frequency == 0:
            if self.left:
                self.QL, self.V = _power_iteration(self.L, self.QL, self.V, 0)
            if self.right:
                self.QR, self.V = _power_iteration(self.R, self.QR, self.V, 1)
        return -N

    def _statistics(self, G):
        self.L = SHAMPOO_BETA * self.L + (1 - SHAMPOO_BETA) * G @ G.T
        self.R = SHAMPOO_BETA * self.R + (1 - SHAMPOO_BETA) * G.T @ G


def _run(config: SoapConfig, params, grads_per_step):
    """The updates of ``config``'s optimizer (jitted) for each tree of gradients in turn."""
    optimizer = config.build(100)
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    out = []
    for grads in grads_per_step:
        updates, state = update(grads, state, params)
        out.append(updates)
    return out, state


def _soap_state(opt_state) -> ScaleBySoapState:
    is_soap = lambda x: isinstance(x, ScaleBySoapState)
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_soap) if is_soap(s)]
    assert len(found) == 1
    return found[0]


def _named_tree(rng, shapes: dict):
    """Random float32 named arrays, each axis named after its array and position."""
    return {
        k: hax.named(rng.normal(size=s).astype(np.float32), tuple(hax.Axis(f"{k}{i}", d) for i, d in enumerate(s)))
        for k, s in shapes.items()
    }


def _grads(rng, params, steps):
    return [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(steps)]


STEPS = 7  # the first sets up the bases; refreshes after Adam steps 2, 4 and 6


def test_updates_follow_the_papers_algorithm_and_max_precond_dim():
    """w (4x4) gets both eigenbases; u (4x6) only the left one, 6 being over max_precond_dim;
    b (6,) none (plain Adam); all are named arrays."""
    rng = np.random.default_rng(0)
    params = _named_tree(rng, {"w": (4, 4), "u": (4, 6), "b": (6,)})
    grads = _grads(rng, params, STEPS)
    config = SoapConfig(
        **PLAIN, precondition_frequency=2, max_precond_dim=5, merge_small_dims=False, partition_grads_into_blocks=False
    )
    ours, state = _run(config, params, grads)
    paper = {
        "w": PaperSoap((4, 4), 2),
        "u": PaperSoap((4, 6), 2, right=False),
        "b": PaperSoap((6, 1), 2, left=False, right=False),
    }
    for step, (g, u) in enumerate(zip(grads, ours)):
        for k, reference in paper.items():
            expected = reference.step(np.asarray(g[k].array).reshape(reference.M.shape))
            expected = expected.reshape(u[k].array.shape)
            np.testing.assert_allclose(u[k].array, expected, rtol=2e-4, atol=2e-5, err_msg=f"{k} at step {step}")
    soap = _soap_state(state)
    # stats per array (in key order b, u, w), per group of blocks, per dimension
    b, u, w = soap.stats
    assert b == [[None]] and u[0][1] is None and u[0][0].shape == (1, 4, 4)
    assert [s.shape for s in w[0]] == [(1, 4, 4), (1, 4, 4)]
    assert jax.tree.structure(soap.mu) == jax.tree.structure(params)  # named arrays, split like the parameters


def test_blocks_are_preconditioned_each_on_its_own():
    """w (8x8) in four 4x4 blocks; v (6x8) with only its rows preconditioned (8 is over
    max_precond_dim), cut into rows 0-4 and a shorter block of rows 4-6."""
    rng = np.random.default_rng(1)
    for shape, max_dim, pieces in [
        ((8, 8), 10000, [(slice(i, i + 4), slice(j, j + 4), True) for i in (0, 4) for j in (0, 4)]),
        ((6, 8), 7, [(slice(0, 4), slice(None), False), (slice(4, 6), slice(None), False)]),
    ]:
        params = _named_tree(rng, {"w": shape})
        grads = _grads(rng, params, STEPS)
        config = SoapConfig(
            **PLAIN, precondition_frequency=2, max_precond_dim=max_dim, merge_small_dims=False, block_size=4
        )
        ours, _ = _run(config, params, grads)
        for rows, cols, right in pieces:
            reference = None
            for step, (g, u) in enumerate(zip(grads, ours)):
                block = np.asarray(g["w"].array)[rows, cols]
                reference = reference or PaperSoap(block.shape, 2, right=right)
                where = f"{shape} {rows} {cols} at step {step}"
                expected = reference.step(block)
                np.testing.assert_allclose(u["w"].array[rows, cols], expected, rtol=2e-4, atol=2e-5, err_msg=where)


def test_small_dimensions_are_merged_as_levanter_merges_them():
    # hand-computed from Levanter's cost: log2(target/d) below the target (+100 log2 below an
    # eighth of it), 10 log2(d/target) above it (+1000 log2 above eight times it)
    assert merged_shape((768, 3, 12, 64), 2048) == (768, 2304)  # ties with (2304, 768): the first found
    assert merged_shape((50257, 768), 2048) == (50257, 768)
    assert merged_shape((32, 96), 2048) == (3072,)
    assert merged_shape((1, 768), 2048) == (768,)
    # and a 2x2x5 tensor steps as the 4x5 matrix it merges into (5 being over max_precond_dim)
    assert merged_shape((2, 2, 5), 4) == (4, 5)
    rng = np.random.default_rng(2)
    params = _named_tree(rng, {"t": (2, 2, 5)})
    grads = _grads(rng, params, STEPS)
    config = SoapConfig(**PLAIN, precondition_frequency=2, max_precond_dim=4, target_merged_dim_size=4)
    ours, _ = _run(config, params, grads)
    reference = PaperSoap((4, 5), 2, right=False)
    for step, (g, u) in enumerate(zip(grads, ours)):
        expected = reference.step(np.asarray(g["t"].array).reshape(4, 5))
        np.testing.assert_allclose(u["t"].array.reshape(4, 5), expected, rtol=2e-4, atol=2e-5, err_msg=f"step {step}")


def test_without_preconditioners_it_is_adam_from_the_second_step():
    rng = np.random.default_rng(3)
    params = _named_tree(rng, {"w": (4, 6), "b": (6,)})
    grads = _grads(rng, params, 5)
    ours, _ = _run(SoapConfig(**PLAIN, max_precond_dim=0), params, grads)
    adam = optax.adam(1.0, B1, B2, EPS)
    state = adam.init(params)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(ours[0]))
    for g, u in zip(grads[1:], ours[1:]):
        expected, state = adam.update(g, state)
        for k in params:
            np.testing.assert_allclose(u[k].array, expected[k].array, rtol=1e-5, atol=1e-7)


# -- a tiny GPT-2 ------------------------------------------------------------------------------------


def _gpt2(**fields):
    from levanter_core.plugins import registry

    config = registry("model").get("gpt2").config_cls(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16, **fields)
    return config.build(hax.Axis("vocab", 64), key=jax.random.PRNGKey(0))


def test_a_stacked_model_steps_as_the_same_model_unrolled():
    """Every layer of the stacked blocks is preconditioned on its own: the updates (three steps,
    the bases refreshed after each Adam step) are those of the unrolled model with the same
    weights and gradients. Only dimensions of 2 or 3 (query/key/value, heads) are preconditioned,
    the first cut into blocks of 2 and 1: their statistics have full rank from the first step,
    so the eigenbases, and the updates, do not hang on rounding (a rank-deficient statistic's
    eigenvectors for its zero eigenvalue are any basis of its null space)."""
    from levanter_core.models.lm import next_token_loss

    stacked = _gpt2()
    template = _gpt2(scan_layers=False)

    def unrolled(tree):
        """``tree``, of the stacked model's structure, in the unrolled model's (arrays only)."""
        layers = list(tree.transformer.blocks.unstacked())
        parts = lambda m: (m.transformer.blocks.blocks, m.transformer.ln_f, m.embeddings)
        tree = eqx.tree_at(parts, template, (layers, tree.transformer.ln_f, tree.embeddings))
        return eqx.filter(tree, eqx.is_inexact_array)

    rng = np.random.default_rng(4)
    grad = eqx.filter_jit(eqx.filter_grad(next_token_loss))
    grads = []
    for _ in range(3):
        tokens = hax.named(jnp.asarray(rng.integers(0, 64, (2, 16)), jnp.int32), ("batch", "position"))
        grads.append(grad(stacked, tokens))
    config = SoapConfig(
        learning_rate=1e-2,
        warmup=0,
        precondition_frequency=1,
        merge_small_dims=False,
        max_precond_dim=3,
        block_size=2,
    )
    arrays = lambda tree: eqx.filter(tree, eqx.is_inexact_array)
    ours, _ = _run(config, arrays(stacked), [arrays(g) for g in grads])
    theirs, _ = _run(config, unrolled(stacked), [unrolled(g) for g in grads])
    for step, (a, b) in enumerate(zip(ours, theirs)):
        a, b = jax.tree.leaves(unrolled(a)), jax.tree.leaves(b)
        assert len(a) == len(b) == 12 * 2 + 4
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7, err_msg=f"step {step}")
    assert float(optax.global_norm(ours[-1])) > 0


def test_training_a_tiny_gpt2_lowers_the_loss():
    from levanter_core.objective import LmObjective
    from levanter_core.plugins import registry
    from levanter_core.trainer.config import TrainerConfig
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer

    gpt2 = registry("model").get("gpt2").config_cls(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16)
    trainer_config = TrainerConfig(train_batch_size=8, num_train_steps=12)
    # Levanter's defaults but for the learning rate and refreshes (after Adam steps 4 and 8)
    optimizer = SoapConfig(learning_rate=3e-2, warmup=0, precondition_frequency=4).build_for_trainer(12)
    trainer = Trainer(trainer_config, optimizer, LmObjective(), mesh=make_mesh(trainer_config))
    state = trainer.init_state(lambda k: gpt2.build(hax.Axis("vocab", 32), key=k), jax.random.PRNGKey(0))
    tokens = np.tile(np.arange(16) % 7, (8, 1))  # a pattern the model can learn in a few steps
    losses = []
    for _ in range(12):
        state, metrics = trainer.train_step(state, tokens)
        losses.append(float(metrics["train/loss"]))
    assert losses[1] == pytest.approx(losses[0])  # the first step only sets up the eigenbases
    assert losses[-1] < 0.5 * losses[0]
    assert int(_soap_state(state.opt_state).count) == 12


# -- the config ----------------------------------------------------------------------------------


def test_levanter_field_names_and_defaults():
    from levanter_core.plugins import registry

    cls = registry("optimizer").get("soap").config_cls
    assert cls is SoapConfig
    defaults = cls()
    betas = (defaults.beta1, defaults.beta2, defaults.shampoo_beta)
    assert (defaults.weight_decay, *betas, defaults.epsilon) == (0.0, 0.95, 0.95, 0.95, 1e-8)
    assert (defaults.max_grad_norm, defaults.precondition_frequency, defaults.max_precond_dim) == (1.0, 10, 10000)
    assert (defaults.merge_small_dims, defaults.one_diag, defaults.target_merged_dim_size) == (True, False, 2048)
    assert (defaults.partition_grads_into_blocks, defaults.block_size) == (True, 256)
    assert (defaults.mu_dtype, defaults.precond_dtype) == (None, None)
    levanter_yaml = {
        "learning_rate": 3e-3,
        "weight_decay": 0.1,
        "beta1": 0.9,
        "beta2": 0.99,
        "shampoo_beta": -1,
        "precondition_frequency": 5,
        "max_precond_dim": 4096,
        "merge_small_dims": False,
        "one_diag": True,
        "target_merged_dim_size": 1024,
        "mu_dtype": "bfloat16",
        "precond_dtype": "float32",
        "partition_grads_into_blocks": False,
        "block_size": 128,
        "schedule_list": None,
        "haps": None,
        "warmup": 0.02,
    }
    loaded = cls.model_validate(levanter_yaml)
    assert loaded.mu_dtype == "bfloat16" and loaded.one_diag and loaded.block_size == 128
    # one_diag: of the 4x6 matrix only the rows get a basis; bfloat16 moments, float32 bases
    params = {"w": hax.named(jnp.ones((4, 6)), ("a", "b"))}
    optimizer = loaded.build(10)
    state = optimizer.init(params)
    soap = _soap_state(state)
    assert soap.mu["w"].array.dtype == jnp.bfloat16 and soap.stats[0][0][0].dtype == jnp.float32
    assert soap.stats[0][0][1] is None
    for _ in range(3):
        updates, state = jax.jit(optimizer.update)({"w": hax.named(jnp.ones((4, 6)), ("a", "b"))}, state, params)
    assert bool(jnp.all(jnp.isfinite(updates["w"].array)))


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"beta1": 1.0}, "beta1"),
        ({"shampoo_beta": 1.0}, "shampoo_beta"),
        ({"precondition_frequency": 0}, "precondition_frequency"),
        ({"block_size": 0}, "block_size"),
        ({"max_precond_dim": -1}, "max_precond_dim"),
        ({"mu_dtype": "int32"}, "not a floating-point dtype"),
        ({"precond_dtype": "float33"}, "not a dtype"),
        ({"schedule_list": ["cosine"]}, "schedule_list has no effect"),
        ({"max_grad_norm": 0}, "max_grad_norm"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields, named):
    with pytest.raises(ValidationError, match=named):
        SoapConfig.model_validate(fields)
