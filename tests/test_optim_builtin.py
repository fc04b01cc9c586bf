"""The built-in optimizers beside AdamW (lion, adopt, rmsprop, cautious) and AdamW's update
clippers and AdamC weight decay: each checked against an independent computation (optax's own
optimizer, or the equations written plainly in float64 numpy), loaded from Levanter's field
names, refused with a clear error on bad values, and trained for a few steps on a tiny GPT-2."""

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

from conftest import Centre, distance_loss
from levanter_core.errors import ConfigError
from levanter_core.optim import AdamConfig, AdoptConfig, CautiousConfig, LionConfig, RMSPropConfig
from levanter_core.optim.transforms import (
    POST_CLIP_UPDATE_NORM,
    PRE_CLIP_UPDATE_NORM,
    ClipUpdateNormState,
    clip_update_by_historical_norm,
    scan_aware_clip_by_block_rms,
)
from levanter_core.plugins import registry
from levanter_core.tracker.jit_log import collecting

STEPS = 5
RUN = 20  # num_train_steps the schedules are built for
RTOL, ATOL = 2e-5, 1e-6

Embed = hax.Axis("embed", 4)
Hidden = hax.Axis("hidden", 6)
Vocab = hax.Axis("vocab", 5)


class Tiny(eqx.Module):
    embed: hnn.Embedding
    proj: hnn.Linear
    gain: jax.Array


@pytest.fixture(scope="module")
def params():
    """Named arrays (an embedding, a linear layer with bias) and a plain array."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    model = Tiny(
        embed=hnn.Embedding.init(Vocab, Embed, key=k1),
        proj=hnn.Linear.init(Embed, Hidden, key=k2),
        gain=jnp.linspace(-1.0, 1.0, 3),
    )
    return jax.tree.map(lambda x: x + 0.5, model)  # a nonzero bias, so decay would show


def gradients(params, steps: int = STEPS, seed: int = 1, scales=None) -> list:
    """Random gradients like ``params``, one tree per step, of global norm ~ 5 (times
    ``scales[t]``), so that clipping to 1 has work to do."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for t in range(steps):
        scale = 1.0 if scales is None else scales[t]
        out.append(treedef.unflatten([jnp.asarray(scale * rng.normal(size=x.shape), jnp.float32) for x in leaves]))
    return out


def run(opt: optax.GradientTransformation, params, grads) -> list[list[np.ndarray]]:
    """The parameters after each step (as float64 leaves), the update jitted."""
    update = jax.jit(opt.update)
    state = opt.init(params)
    history = []
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        history.append([np.asarray(x, np.float64) for x in jax.tree.leaves(params)])
    return history


def assert_same_run(ours, reference):
    assert len(ours) == len(reference)
    for step, (a, b) in enumerate(zip(ours, reference)):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL, err_msg=f"step {step}")


# -- float64 numpy versions of the equations -----------------------------------------------------


def np_leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def np_mask(config, params) -> list[bool]:
    mask = config.build_weight_decay_mask()
    return [True] * len(jax.tree.leaves(params)) if mask is None else [bool(m) for m in jax.tree.leaves(mask(params))]


def np_lrs(config) -> list[float]:
    schedule = config.lr_scheduler(RUN)
    return [float(schedule(t)) for t in range(RUN)]


def np_clip_global(gs, max_norm):
    if max_norm is None:
        return gs
    norm = np.sqrt(sum((g**2).sum() for g in gs))
    return gs if norm <= max_norm else [g * max_norm / norm for g in gs]


def np_global_norm(xs) -> float:
    return float(np.sqrt(sum((x**2).sum() for x in xs)))


class NpAdam:
    """Bias-corrected Adam: ``m_hat / (sqrt(v_hat) + eps)``."""

    def __init__(self, b1, b2, eps, shapes):
        self.b1, self.b2, self.eps, self.t = b1, b2, eps, 0
        self.m = [np.zeros(s) for s in shapes]
        self.v = [np.zeros(s) for s in shapes]

    def __call__(self, gs):
        self.t += 1
        out = []
        for i, g in enumerate(gs):
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g**2
            m_hat = self.m[i] / (1 - self.b1**self.t)
            v_hat = self.v[i] / (1 - self.b2**self.t)
            out.append(m_hat / (np.sqrt(v_hat) + self.eps))
        return out


def np_run(config, params, grads, direction, *, decay_scale=lambda lr: 1.0, post=lambda us, step: us):
    """Parameters after each step of: clip grads, ``direction`` (the optimizer's scaling), add
    ``weight_decay * decay_scale(lr_t) * p`` where the mask says, ``post``, times ``-lr_t``."""
    ps = np_leaves(params)
    mask = np_mask(config, params)
    lrs = np_lrs(config)
    history = []
    for t, g in enumerate(grads):
        gs = np_clip_global(np_leaves(g), config.max_grad_norm)
        us = direction(gs)
        wd = config.weight_decay * decay_scale(lrs[t])
        us = [u + wd * p if m else u for u, p, m in zip(us, ps, mask)]
        us = post(us, t)
        ps = [p - lrs[t] * u for p, u in zip(ps, us)]
        history.append(ps)
    return history


# -- each optimizer against an independent computation ----------------------------------------


SCHEDULE = dict(learning_rate=0.05, warmup=2, lr_schedule="cosine", min_lr_ratio=0.2)


def test_adam_matches_optax_adamw(params):
    config = AdamConfig(**SCHEDULE, weight_decay=0.3, beta2=0.9)
    reference = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(config.lr_scheduler(RUN), 0.9, 0.9, 1e-8, weight_decay=0.3, mask=config.build_weight_decay_mask()),
    )
    grads = gradients(params)
    assert_same_run(run(config.build(RUN), params, grads), run(reference, params, grads))


def test_lion_matches_optax_lion(params):
    config = LionConfig(**SCHEDULE, weight_decay=0.3, beta1=0.8, beta2=0.9, max_grad_norm=2.0)
    reference = optax.chain(
        optax.clip_by_global_norm(2.0),
        optax.lion(config.lr_scheduler(RUN), 0.8, 0.9, weight_decay=0.3, mask=config.build_weight_decay_mask()),
    )
    grads = gradients(params)
    assert_same_run(run(config.build(RUN), params, grads), run(reference, params, grads))


def test_adopt_matches_optax_contrib_adopt(params):
    config = AdoptConfig(**SCHEDULE, weight_decay=0.0, beta2=0.9)
    reference = optax.chain(
        optax.clip_by_global_norm(1.0), optax.contrib.adopt(config.lr_scheduler(RUN), 0.9, 0.9, 1e-6)
    )
    grads = gradients(params)
    assert_same_run(run(config.build(RUN), params, grads), run(reference, params, grads))


def test_adopt_follows_the_papers_equations_with_weight_decay(params):
    config = AdoptConfig(**SCHEDULE, weight_decay=0.3, beta1=0.8, beta2=0.9, epsilon=1e-6)
    shapes = [x.shape for x in np_leaves(params)]
    state = {"t": 0, "m": [np.zeros(s) for s in shapes], "v": None}

    def adopt(gs):
        t = state["t"]
        state["t"] += 1
        if state["v"] is None:  # the first step only records g^2 and does not move
            state["v"] = [g**2 for g in gs]
            return [np.zeros_like(g) for g in gs]
        bound = t**0.25
        normalized = [np.clip(g / np.maximum(np.sqrt(v), 1e-6), -bound, bound) for g, v in zip(gs, state["v"])]
        state["m"] = [0.8 * m + 0.2 * n for m, n in zip(state["m"], normalized)]
        state["v"] = [0.9 * v + 0.1 * g**2 for v, g in zip(state["v"], gs)]
        return list(state["m"])

    grads = gradients(params)
    assert_same_run(run(config.build(RUN), params, grads), np_run(config, params, grads, adopt))


def test_rmsprop_without_momentum_matches_optax_rmsprop(params):
    config = RMSPropConfig(**SCHEDULE, weight_decay=0.0, beta1=0.0, beta2=0.9, eps=1e-8)
    reference = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.rmsprop(config.lr_scheduler(RUN), decay=0.9, eps=1e-8, eps_in_sqrt=False, bias_correction=True),
    )
    grads = gradients(params)
    assert_same_run(run(config.build(RUN), params, grads), run(reference, params, grads))


def test_rmsprop_momentum_follows_levanters_equations(params):
    config = RMSPropConfig(**SCHEDULE, weight_decay=0.3)  # beta1 0.9, beta2 0.99, eps 1e-30
    shapes = [x.shape for x in np_leaves(params)]
    state = {"t": 0, "ms": [np.zeros(s) for s in shapes], "mom": [np.zeros(s) for s in shapes]}

    def rmsprop(gs):
        state["t"] += 1
        t = state["t"]
        out = []
        for i, g in enumerate(gs):
            state["ms"][i] = 0.99 * state["ms"][i] + 0.01 * g**2
            scaled = g / (np.sqrt(state["ms"][i] / (1 - 0.99**t)) + 1e-30)
            state["mom"][i] = 0.9 * state["mom"][i] + 0.1 * scaled
            out.append(state["mom"][i] / (1 - 0.9**t))
        return out

    grads = gradients(params)
    assert_same_run(run(config.build(RUN), params, grads), np_run(config, params, grads, rmsprop))


def test_cautious_follows_the_papers_equations(params):
    config = CautiousConfig(**SCHEDULE, weight_decay=0.3, beta1=0.9, beta2=0.95)
    shapes = [x.shape for x in np_leaves(params)]
    adam = NpAdam(0.9, 0.95, 1e-8, shapes)

    def cautious(gs):
        out = []
        for u, g in zip(adam(gs), gs):
            keep = (u * g > 0).astype(np.float64)
            out.append(u * keep / (keep.mean() + 1e-8))
        return out

    grads = gradients(params)
    ours = run(config.build(RUN), params, grads)
    assert_same_run(ours, np_run(config, params, grads, cautious))


def test_cautious_zeroes_coordinates_against_the_gradient():
    opt = CautiousConfig(learning_rate=1.0, warmup=0, lr_schedule="constant", weight_decay=0.0, max_grad_norm=None)
    opt = opt.build(RUN)
    params = {"w": jnp.zeros(4)}
    state = opt.init(params)
    _, state = opt.update({"w": jnp.array([1.0, 1.0, 1.0, 1.0])}, state, params)
    # Momentum still points +, but two gradients now point -: those two coordinates stop,
    # and the other two move twice as far (mask mean 1/2).
    updates, _ = opt.update({"w": jnp.array([1.0, 1.0, -0.01, -0.01])}, state, params)
    u = np.asarray(updates["w"])
    assert u[2] == 0 and u[3] == 0
    plain = optax.scale_by_adam(0.95, 0.95)
    s = plain.init(params)
    _, s = plain.update({"w": jnp.ones(4)}, s)
    adam_u, _ = plain.update({"w": jnp.array([1.0, 1.0, -0.01, -0.01])}, s)
    np.testing.assert_allclose(u[:2], -2 * np.asarray(adam_u["w"][:2]), rtol=1e-6)


@pytest.mark.parametrize("optimizer", ["adam", "cautious"])
def test_adamc_scales_weight_decay_by_the_learning_rate_over_its_peak(params, optimizer):
    config = registry("optimizer").get(optimizer).config_cls(**SCHEDULE, weight_decay=0.5, adamc_weight_decay=True)
    shapes = [x.shape for x in np_leaves(params)]
    adam = NpAdam(config.beta1, config.beta2, config.epsilon, shapes)

    def direction(gs):
        us = adam(gs)
        if optimizer == "cautious":
            us = [u * (u * g > 0) / ((u * g > 0).mean() + config.epsilon) for u, g in zip(us, gs)]
        return us

    grads = gradients(params)
    expected = np_run(config, params, grads, direction, decay_scale=lambda lr: lr / SCHEDULE["learning_rate"])
    assert_same_run(run(config.build(RUN), params, grads), expected)
    # and it is not the constant decay (the schedule is below its peak on most steps);
    # `direction` reads this fresh Adam state
    adam = NpAdam(config.beta1, config.beta2, config.epsilon, shapes)
    constant = np_run(config, params, grads, direction)
    assert not all(np.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(expected[-1], constant[-1]))


def test_update_rms_clipping_follows_the_equations(params):
    config = AdamConfig(**SCHEDULE, weight_decay=0.3, update_rms_clipping=0.7)
    shapes = [x.shape for x in np_leaves(params)]
    adam = NpAdam(0.9, 0.95, 1e-8, shapes)
    clipped = []

    def rms_clip(us, step):
        out = []
        for u in us:
            rms = np.sqrt((u**2).mean())
            clipped.append(rms > 0.7)
            out.append(u / max(1.0, rms / 0.7))
        return out

    grads = gradients(params)
    expected = np_run(config, params, grads, adam, post=rms_clip)
    assert_same_run(run(config.build(RUN), params, grads), expected)
    assert any(clipped) and not all(clipped)  # both branches were exercised


def test_clip_update_norm_follows_the_equations(params):
    window, sigma = 4, 0.5
    section = {"rolling_interval_length": window, "sigma_factor": sigma}
    config = AdamConfig(**SCHEDULE, weight_decay=0.3, clip_update_norm=section)
    shapes = [x.shape for x in np_leaves(params)]
    adam = NpAdam(0.9, 0.95, 1e-8, shapes)
    history, clipped = [], []

    def clip(us, step):
        norm = np_global_norm(us)
        recent = np.array(history[-window:])
        if len(recent) >= max(2, window // 2):
            limit = recent.mean() + sigma * max(recent.std(), 1e-6)  # population std, as Levanter
            if norm > limit:
                clipped.append(step)
                us = [u * limit / norm for u in us]
        history.append(norm)  # the unclipped norm
        return us

    steps = 10
    # With no gradient the update is the weight decay alone, a steady norm; then the
    # gradients come in and the norm jumps.
    scales = [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    grads = gradients(params, steps, scales=scales)
    expected = np_run(config, params, grads, adam, post=clip)
    assert_same_run(run(config.build(RUN), params, grads), expected)
    assert 4 in clipped and all(step >= 2 for step in clipped)


def test_clip_update_norm_state_and_logs():
    window, sigma = 4, 1.0
    clipper = clip_update_by_historical_norm(window, sigma)
    norms = [1.0, 1.2, 0.8, 1.0, 9.0, 1.1, float("nan"), 1.0]
    direction = np.array([3.0, 4.0]) / 5.0

    def step(state, norm):
        with collecting() as logged:
            out, state = clipper.update({"u": jnp.asarray(norm * direction, jnp.float32)}, state)
        return out, state, dict(logged)

    step = jax.jit(step)
    state = clipper.init(None)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))  # checkpointable
    recorded, did_clip = [], []
    for norm in norms:
        out, state, logged = step(state, norm)
        out_norm = float(np.linalg.norm(np.asarray(out["u"])))
        assert set(logged) == {
            "optim/clip_update/did_clip",
            "optim/clip_update/pre_clip_norm",
            "optim/clip_update/update_norm_threshold",
            "optim/clip_update/post_clip_norm",
        }
        if np.isnan(norm):
            assert np.isnan(out_norm)
            continue
        window_now = np.array(recorded[-window:])
        limit = window_now.mean() + sigma * max(window_now.std(), 1e-6) if len(window_now) >= 2 else np.inf
        expect = min(norm, limit)
        assert out_norm == pytest.approx(expect, rel=1e-5)
        assert float(logged["optim/clip_update/did_clip"]) == float(norm > limit)
        did_clip.append(bool(norm > limit))
        assert float(logged["optim/clip_update/pre_clip_norm"]) == pytest.approx(norm, rel=1e-6)
        assert float(logged["optim/clip_update/post_clip_norm"]) == pytest.approx(expect, rel=1e-5)
        if len(window_now) >= 2:
            assert float(logged["optim/clip_update/update_norm_threshold"]) == pytest.approx(limit, rel=1e-5)
        recorded.append(norm)
    assert did_clip == [False, False, False, False, True, False, False]  # only the spike
    # The NaN was not recorded; the ring holds the last 4 unclipped norms, the spike's included.
    assert int(state.recorded) == len(norms) - 1
    np.testing.assert_allclose(np.asarray(state.norms), [9.0, 1.1, 1.0, 1.0], rtol=1e-6)


@pytest.mark.parametrize(
    "clipper", [{"update_rms_clipping": 0.5}, {"clip_update_norm": {"rolling_interval_length": 2}}]
)
def test_update_clippers_log_the_norm_before_and_after(params, clipper):
    config = AdamConfig(**SCHEDULE, weight_decay=0.0, **clipper)
    opt = config.build(RUN)

    def update(g, state):
        with collecting() as logged:
            u, state = opt.update(g, state, params)
        return u, state, dict(logged)

    update = jax.jit(update)
    state = opt.init(params)
    lrs = np_lrs(config)
    for t, g in enumerate(gradients(params, 4, scales=[1, 1, 1, 50])):
        u, state, logged = update(g, state)
        assert {PRE_CLIP_UPDATE_NORM, POST_CLIP_UPDATE_NORM} <= set(logged)
        assert ("optim/clip_update/did_clip" in logged) == ("clip_update_norm" in clipper)
        if lrs[t] > 0:
            # the update after clipping is what the parameters receive, times -lr
            assert float(logged[POST_CLIP_UPDATE_NORM]) == pytest.approx(float(optax.global_norm(u)) / lrs[t], rel=1e-5)
        assert float(logged[POST_CLIP_UPDATE_NORM]) <= float(logged[PRE_CLIP_UPDATE_NORM]) * (1 + 1e-6)


# -- stacked layers --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2():
    Gpt2 = registry("model").get("gpt2").config_cls
    return Gpt2(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16).build(Vocab.resize(64), key=jax.random.PRNGKey(0))


def has_layers(x: hax.NamedArray) -> bool:
    return any(axis.name == "layers" for axis in x.axes)


def test_rms_clipping_clips_each_stacked_layer_on_its_own(gpt2):
    is_stacked = lambda x: isinstance(x, hnn.Stacked)
    assert len([x for x in jax.tree.leaves(gpt2, is_leaf=is_stacked) if is_stacked(x)]) == 1
    Layers = hax.Axis("layers", 2)
    layer_scale = hax.named(jnp.array([100.0, 0.01]), Layers)

    def scaled(x):  # layer 0's update is large, layer 1's small
        if hax.is_named_array(x) and has_layers(x):
            return x * layer_scale
        return x

    clipper = scan_aware_clip_by_block_rms(0.5)

    @jax.jit  # one compilation for all of it: op by op, every small shape would compile
    def scale_and_clip(params):
        updates = jax.tree.map(scaled, params, is_leaf=hax.is_named_array)
        ours, _ = clipper.update(updates, clipper.init(params))
        # Clipping each stacked array as one block, for contrast.
        joint, _ = optax.clip_by_block_rms(0.5).update(updates, optax.EmptyState())
        return updates, ours, joint

    updates, clipped, joint = scale_and_clip(eqx.filter(gpt2, eqx.is_inexact_array))

    def rms(a):
        return float(np.sqrt(np.mean(np.asarray(a, np.float64) ** 2)))

    checked = 0
    named = lambda tree: jax.tree.leaves(tree, is_leaf=hax.is_named_array)
    for before, after in zip(named(updates), named(clipped)):
        if not has_layers(before):
            expected = np.asarray(before.array) / max(1.0, rms(before.array) / 0.5)
            np.testing.assert_allclose(np.asarray(after.array), expected, rtol=1e-5, atol=1e-7)
            continue
        assert after.axes == before.axes
        axis = [a.name for a in before.axes].index("layers")
        for layer in range(2):
            b, a = (np.take(np.asarray(x.array), layer, axis=axis) for x in (before, after))
            if rms(b) > 0.5:
                assert rms(a) == pytest.approx(0.5, rel=1e-5)
                checked += 1
            else:  # the small layer is untouched, whatever the other layer's size
                np.testing.assert_array_equal(a, b)
    assert checked >= 4
    # Clipping the stacked array as one block would have shrunk the small layer too.
    c_fc = lambda tree: tree.transformer.blocks.stacked.mlp.c_fc.weight
    assert not np.allclose(np.asarray(c_fc(joint)["layers", 1].array), np.asarray(c_fc(updates)["layers", 1].array))


# -- configs -------------------------------------------------------------------------------------

LEVANTER_DEFAULTS = {
    "adam": dict(
        beta1=0.9,
        beta2=0.95,
        epsilon=1e-8,
        max_grad_norm=1.0,
        nesterov=False,
        update_rms_clipping=None,
        clip_update_norm=None,
        adamc_weight_decay=False,
    ),
    "lion": dict(beta1=0.9, beta2=0.95, epsilon=1e-8, max_grad_norm=1.0),
    "adopt": dict(
        weight_decay=0.1, beta1=0.9, beta2=0.95, epsilon=1e-6, max_grad_norm=1.0, haps=None, schedule_list=None
    ),
    "rmsprop": dict(beta1=0.9, beta2=0.99, eps=1e-30, max_grad_norm=1.0, weight_decay=0.1),
    "cautious": dict(beta1=0.95, beta2=0.95, gamma=0.025, epsilon=1e-8, max_grad_norm=1.0, adamc_weight_decay=False),
}


@pytest.mark.parametrize("name", sorted(LEVANTER_DEFAULTS))
def test_levanters_fields_and_defaults(name):
    cls = registry("optimizer").get(name).config_cls
    default = cls()
    for field, value in LEVANTER_DEFAULTS[name].items():
        assert getattr(default, field) == value, field
    # Every field is documented (the docstrings become --help and the reference).
    assert all(info.description for info in cls.model_fields.values())
    # Levanter's names load, with values other than the defaults.
    changed = {f: (v * 0.5 if isinstance(v, float) and v else v) for f, v in LEVANTER_DEFAULTS[name].items()}
    loaded = cls.model_validate({"type": name, **changed})
    assert {f: getattr(loaded, f) for f in changed} == changed
    loaded.build(10)


def test_clip_update_norm_section_loads():
    config = AdamConfig.model_validate({"clip_update_norm": {"rolling_interval_length": 64, "sigma_factor": 2.0}})
    assert config.clip_update_norm.rolling_interval_length == 64 and config.clip_update_norm.sigma_factor == 2.0
    assert AdamConfig.model_validate({"clip_update_norm": {}}).clip_update_norm.sigma_factor == 3.0


def write_run(tmp_path, optimizer_yaml: str):
    path = tmp_path / "run.yaml"
    path.write_text(
        "data: {type: python_stdlib, tokenizer: byte, cache_dir: " + str(tmp_path / "cache") + "}\n"
        "model: {type: gpt2}\n"
        "optimizer:\n" + optimizer_yaml
    )
    return str(path)


LEVANTER_YAML = [
    (
        "  type: adam\n  update_rms_clipping: 1.0\n  adamc_weight_decay: true\n",
        lambda opt: type(opt) is AdamConfig and opt.update_rms_clipping == 1.0 and opt.adamc_weight_decay,
    ),
    (
        "  type: adam\n  clip_update_norm:\n    rolling_interval_length: 32\n    sigma_factor: 2.5\n",
        lambda opt: opt.clip_update_norm.rolling_interval_length == 32 and opt.clip_update_norm.sigma_factor == 2.5,
    ),
    (
        "  type: lion\n  learning_rate: 1e-4\n  beta2: 0.99\n  weight_decay: 1.0\n",
        lambda opt: type(opt) is LionConfig and opt.beta2 == 0.99 and opt.weight_decay == 1.0,
    ),
    ("  type: adopt\n  beta2: 0.9999\n  epsilon: 1e-6\n", lambda opt: type(opt) is AdoptConfig and opt.beta2 == 0.9999),
    ("  type: rmsprop\n  beta1: 0.9\n  eps: 1e-8\n", lambda opt: type(opt) is RMSPropConfig and opt.eps == 1e-8),
    (
        "  type: cautious\n  gamma: 0.025\n  adamc_weight_decay: true\n",
        lambda opt: type(opt) is CautiousConfig and opt.adamc_weight_decay,
    ),
]


@pytest.mark.parametrize("yaml, check", LEVANTER_YAML)
def test_levanter_yaml_sections_load(tmp_path, yaml, check):
    from levanter_core.config.train import load_train_config

    config, _ = load_train_config(write_run(tmp_path, yaml))
    assert check(config.optimizer)


@pytest.mark.parametrize(
    "yaml, message",
    [
        ("  update_rms_clipping: 1.0\n  clip_update_norm: {}\n", r"cannot be used together; set one of them to null"),
        ("  update_rms_clipping: 0\n", r"optimizer\.update_rms_clipping .*greater than 0"),
        (
            "  clip_update_norm: {rolling_interval_length: 1}\n",
            r"optimizer\.clip_update_norm\.rolling_interval_length .*greater than or equal to 2",
        ),
        ("  clip_update_norm: {sigma_factor: -1}\n", r"optimizer\.clip_update_norm\.sigma_factor .*greater than 0"),
        ("  clip_update_norm: {window: 8}\n", r"optimizer\.clip_update_norm\.window .*unknown field"),
        ("  type: lion\n  beta2: 1.0\n", r"optimizer\.beta2 .*less than 1"),
        ("  type: adopt\n  schedule_list: [cosine]\n", r"optimizer\.schedule_list .*no effect in Levanter's ADOPT"),
        ("  type: rmsprop\n  eps: -1e-8\n", r"optimizer\.eps .*greater than or equal to 0"),
        ("  type: rmsprop\n  epsilon: 1e-8\n", r"optimizer\.epsilon .*unknown field"),
        ("  type: cautious\n  beta1: 1.5\n", r"optimizer\.beta1 .*less than 1"),
        ("  type: cautious\n  max_grad_norm: 0\n", r"optimizer\.max_grad_norm .*greater than 0"),
    ],
)
def test_bad_values_are_clear_errors(tmp_path, yaml, message):
    from levanter_core.config.train import load_train_config

    with pytest.raises(ConfigError, match=message):
        load_train_config(write_run(tmp_path, yaml))


def test_every_state_is_arrays(params):
    """Checkpointable: the optimizer state is a pytree of arrays, for every optimizer."""
    configs = [
        AdamConfig(update_rms_clipping=1.0, adamc_weight_decay=True),
        AdamConfig(clip_update_norm={}, skip_bad_steps=True),
        LionConfig(),
        AdoptConfig(),
        RMSPropConfig(),
        CautiousConfig(adamc_weight_decay=True),
    ]
    for config in configs:
        state = config.build_for_trainer(RUN).init(params)
        leaves = jax.tree.leaves(state)
        assert leaves and all(isinstance(x, jax.Array) for x in leaves), type(config).__name__


# -- training ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_loss_and_grad():
    """The loss on a fixed batch and its gradient, compiled once for every optimizer."""
    from levanter_core.models.lm import next_token_loss

    ids = np.random.default_rng(0).integers(0, 64, (4, 16))
    tokens = hax.named(jnp.asarray(ids, jnp.int32), ("batch", "position"))
    return eqx.filter_jit(eqx.filter_value_and_grad(lambda m: next_token_loss(m, tokens)))


@pytest.mark.parametrize(
    "config",
    [
        LionConfig(learning_rate=3e-3, warmup=0, weight_decay=0.1),
        AdoptConfig(learning_rate=1e-2, warmup=0),
        RMSPropConfig(learning_rate=3e-3, warmup=0),
        CautiousConfig(learning_rate=1e-2, warmup=0),
        AdamConfig(learning_rate=1e-2, warmup=0, update_rms_clipping=1.0),
        AdamConfig(
            learning_rate=1e-2, warmup=0, clip_update_norm={"rolling_interval_length": 4}, adamc_weight_decay=True
        ),
    ],
    ids=["lion", "adopt", "rmsprop", "cautious", "adam-rms-clip", "adam-clip-update-norm-adamc"],
)
def test_a_few_steps_lower_the_loss_of_a_tiny_gpt2(gpt2, gpt2_loss_and_grad, config):
    opt = config.build_for_trainer(RUN)
    update = jax.jit(opt.update)
    model = gpt2
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for _ in range(8):
        loss, grads = gpt2_loss_and_grad(model)
        updates, state = update(grads, state, eqx.filter(model, eqx.is_inexact_array), loss=loss)
        model = eqx.apply_updates(model, updates)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.2, losses


Pos = hax.Axis("position", 16)


def test_the_trainer_logs_the_clip_and_a_checkpoint_keeps_its_window(tmp_path):
    from levanter_core.checkpoint import load_checkpoint, write_checkpoint
    from levanter_core.trainer.config import TrainerConfig
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer

    config = TrainerConfig(train_batch_size=8, num_train_steps=100)
    optimizer = AdamConfig(
        learning_rate=0.01, warmup=0, lr_schedule="constant", clip_update_norm={"rolling_interval_length": 4}
    ).build_for_trainer(config.num_train_steps)
    trainer = Trainer(config, optimizer, distance_loss, mesh=make_mesh(config))

    def model_init(key):
        return Centre(hax.random.normal(key, (Embed,)))

    key = jax.random.PRNGKey(0)
    rng = np.random.default_rng(0)
    state = trainer.init_state(model_init, key)
    for _ in range(3):
        state, metrics = trainer.train_step(state, rng.integers(0, 10, (8, Pos.size)))
    for name in [
        PRE_CLIP_UPDATE_NORM,
        POST_CLIP_UPDATE_NORM,
        "optim/clip_update/did_clip",
        "optim/clip_update/update_norm_threshold",
    ]:
        assert np.isfinite(float(metrics[name])), name
    write_checkpoint(state, str(tmp_path / "step-3"), step=3)
    resumed = load_checkpoint(trainer.state_template(model_init, key), str(tmp_path / "step-3"))

    def window(opt_state) -> ClipUpdateNormState:
        is_window = lambda x: isinstance(x, ClipUpdateNormState)
        (found,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_window) if is_window(s)]
        return found

    assert int(window(resumed.opt_state).recorded) == 3
    np.testing.assert_array_equal(
        np.asarray(window(resumed.opt_state).norms), np.asarray(window(state.opt_state).norms)
    )
