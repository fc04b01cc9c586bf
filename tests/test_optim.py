import itertools
import operator

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import Centre, distance_loss
from levanter_core.errors import ConfigError
from levanter_core.optim import AdamConfig, SkipStepConfig, parameter_path
from levanter_core.optim.skipstep import skipped_step

PEAK = 1.0
MIN = 0.1  # the default min_lr_ratio times PEAK


def lrs(config: AdamConfig, steps, num_train_steps: int = 100) -> list[float]:
    schedule = config.lr_scheduler(num_train_steps)
    return [float(schedule(step)) for step in steps]


# -- learning-rate schedule ------------------------------------------------------------------


def test_warmup_in_steps_and_as_fraction_agree():
    in_steps = lrs(AdamConfig(learning_rate=PEAK, warmup=10), range(101))
    as_fraction = lrs(AdamConfig(learning_rate=PEAK, warmup=0.1), range(101))
    assert in_steps == as_fraction
    assert in_steps[0] == 0.0
    assert in_steps[5] == pytest.approx(PEAK / 2)
    assert in_steps[10] == pytest.approx(PEAK)


def test_cosine_decays_to_min_lr_over_everything_after_warmup():
    lr = lrs(AdamConfig(learning_rate=PEAK, warmup=10), [10, 55, 99, 100, 150])
    assert lr[0] == pytest.approx(PEAK)
    assert lr[1] == pytest.approx((PEAK + MIN) / 2)  # halfway through the decay
    assert MIN < lr[2] < MIN + 1e-3
    assert lr[3] == pytest.approx(MIN)
    assert lr[4] == pytest.approx(MIN)  # stays at the minimum past the end


def test_linear_and_constant_shapes():
    linear = lrs(AdamConfig(learning_rate=PEAK, warmup=10, lr_schedule="linear"), [10, 55, 100])
    assert linear == pytest.approx([PEAK, (PEAK + MIN) / 2, MIN])
    constant = lrs(AdamConfig(learning_rate=PEAK, warmup=10, lr_schedule="constant"), [5, 10, 55, 100])
    assert constant == pytest.approx([PEAK / 2, PEAK, PEAK, PEAK])


@pytest.mark.parametrize("shape", ["inv_sqrt", "inv"])
def test_inverse_shapes_fall_from_peak_to_exactly_min(shape):
    lr = lrs(AdamConfig(learning_rate=PEAK, warmup=10, lr_schedule=shape), range(10, 101))
    assert lr[0] == pytest.approx(PEAK)
    assert lr[-1] == pytest.approx(MIN, rel=1e-5)
    assert all(a > b for a, b in itertools.pairwise(lr))
    # Steeper than linear early on: that is the point of these shapes.
    assert lr[45] < (PEAK + MIN) / 2


def test_inv_sqrt_needs_a_nonzero_minimum():
    with pytest.raises(ValueError, match="never reaches 0"):
        AdamConfig(lr_schedule="inv_sqrt", min_lr_ratio=0.0)


def test_decay_fraction_leaves_a_stable_phase_at_peak():
    lr = lrs(AdamConfig(learning_rate=PEAK, warmup=10, decay=0.2), [10, 50, 80, 90, 100])
    assert lr[:3] == pytest.approx([PEAK, PEAK, PEAK])
    assert lr[3] == pytest.approx((PEAK + MIN) / 2)
    assert lr[4] == pytest.approx(MIN)


def test_two_cycles_without_rewarmup_jump_back_to_peak():
    lr = lrs(AdamConfig(learning_rate=PEAK, warmup=0.1, cycles=2), range(101))
    # warmup is a fraction of the first cycle (50 steps)
    assert lr[5] == pytest.approx(PEAK)
    assert lr[50] == pytest.approx(PEAK)
    minima = [i for i in range(1, 100) if lr[i] < lr[i - 1] and lr[i] < lr[i + 1]]
    assert minima == [49]
    assert lr[49] == pytest.approx(MIN, abs=2e-3)
    assert lr[100] == pytest.approx(MIN)
    # the second cycle decays like the first, after its (absent) warmup
    assert lr[75] == pytest.approx((PEAK + MIN) / 2)


def test_rewarmup_ramps_from_previous_minimum_back_to_peak():
    lr = lrs(AdamConfig(learning_rate=PEAK, warmup=5, cycles=2, rewarmup=10), [50, 55, 60])
    assert lr == pytest.approx([MIN, (MIN + PEAK) / 2, PEAK])


def test_cycle_length_is_equivalent_to_cycles():
    by_count = lrs(AdamConfig(warmup=5, cycles=4), range(101))
    assert lrs(AdamConfig(warmup=5, cycle_length=25), range(101)) == by_count
    assert lrs(AdamConfig(warmup=5, cycle_length=0.25), range(101)) == by_count
    assert lrs(AdamConfig(warmup=5, cycle_length=[25, 25, 25]), range(101)) == by_count
    assert lrs(AdamConfig(warmup=5, cycles=[25, 50, 75]), range(101)) == by_count


def test_cycles_and_cycle_length_together_are_an_error():
    with pytest.raises(ValueError, match="It is an error to specify both"):
        AdamConfig(cycles=2, cycle_length=50)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"warmup": -0.1}, "not negative"),
        ({"decay": 2.5}, "must be whole"),
        ({"cycle_length": 0}, "must be positive"),
        ({"cycles": [60, 40]}, "increasing order"),
        ({"weight_decay_modules": "attn("}, "invalid regular expression"),
    ],
)
def test_invalid_values_are_rejected_when_loading(fields, message):
    with pytest.raises(ValueError, match=message):
        AdamConfig(**fields)


def test_phases_that_do_not_fit_the_run_are_config_errors():
    with pytest.raises(ConfigError, match="too short for warmup \\(80 steps\\) plus decay \\(40 steps\\)"):
        AdamConfig(warmup=80, decay=40).lr_scheduler(100)
    with pytest.raises(ConfigError, match="past the end of training"):
        AdamConfig(cycles=[50, 150]).lr_scheduler(100)


def test_schedule_works_with_a_traced_step():
    schedule = AdamConfig(learning_rate=PEAK, warmup=10, cycles=2, rewarmup=5).lr_scheduler(100)
    steps = jnp.arange(101)
    traced = jax.jit(jax.vmap(schedule))(steps)
    assert np.allclose(traced, [float(schedule(int(s))) for s in steps])


# -- AdamW -------------------------------------------------------------------------------------

Embed = hax.Axis("embed", 4)
Hidden = hax.Axis("hidden", 3)
Vocab = hax.Axis("vocab", 5)


class Block(eqx.Module):
    ln: hnn.LayerNorm
    attn: hnn.Linear


class Tiny(eqx.Module):
    embed: hnn.Embedding
    block: Block
    head: hnn.Linear


@pytest.fixture(scope="module")
def tiny():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    model = Tiny(
        embed=hnn.Embedding.init(Vocab, Embed, key=k1),
        block=Block(hnn.LayerNorm.init(Embed), hnn.Linear.init(Embed, Hidden, key=k2)),
        head=hnn.Linear.init(Hidden, Vocab, key=k3),
    )
    # biases and norm offsets start at 0; give them values so decay would show
    return jax.tree.map(lambda x: x + 1.0, model)


def decayed_paths(config: AdamConfig, params) -> set[str]:
    mask = config.build_weight_decay_mask()(params)
    flat, _ = jax.tree_util.tree_flatten_with_path(mask)
    return {parameter_path(path) for path, decayed in flat if decayed}


def test_one_step_moves_params_by_the_learning_rate():
    opt = AdamConfig(learning_rate=0.1, warmup=0, weight_decay=0.0, max_grad_norm=None).build(10)
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.array([2.0, -3.0, 0.5])}
    updates, _ = opt.update(grads, opt.init(params), params)
    new = optax.apply_updates(params, updates)
    # Adam's first step is sign(grad) * lr
    assert np.allclose(new["w"], [0.9, 1.1, 0.9])


def test_gradient_clipping_caps_the_global_norm():
    opt = AdamConfig(learning_rate=0.1, warmup=0, weight_decay=0.0, max_grad_norm=1.0).build(10)
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    huge = {"a": jnp.array([3000.0, -4000.0]), "b": jnp.array([0.0, 12000.0, 0.0])}  # norm 13000
    clipped = jax.tree.map(lambda g: g / 13000.0, huge)

    state = opt.init(params)
    updates_huge, state_huge = opt.update(huge, state, params)
    updates_clipped, state_clipped = opt.update(clipped, state, params)

    mu = optax.tree_utils.tree_get(state_huge, "mu")
    assert float(optax.global_norm(mu)) == pytest.approx(0.1 * 1.0)  # (1 - beta1) * max_grad_norm
    for x, y in zip(jax.tree.leaves((updates_huge, state_huge)), jax.tree.leaves((updates_clipped, state_clipped))):
        assert np.allclose(x, y)


def test_default_mask_decays_linear_weights_only(tiny):
    assert decayed_paths(AdamConfig(), tiny) == {"block.attn.weight", "head.weight"}

    # With zero gradients Adam's update is 0, so the step is pure weight decay.
    opt = AdamConfig(learning_rate=1.0, warmup=0, weight_decay=0.5, max_grad_norm=None).build(10)
    grads = jax.tree.map(jnp.zeros_like, tiny)
    updates, _ = opt.update(grads, opt.init(tiny), tiny)
    new = optax.apply_updates(tiny, updates)

    assert np.allclose(new.head.weight.array, 0.5 * tiny.head.weight.array)
    assert np.allclose(new.block.attn.weight.array, 0.5 * tiny.block.attn.weight.array)
    for unchanged in ("embed.weight", "block.ln.weight", "block.ln.bias", "block.attn.bias", "head.bias"):
        get = operator.attrgetter(unchanged)
        assert np.array_equal(get(new).array, get(tiny).array), unchanged


def test_mask_has_one_bool_per_named_array(tiny):
    mask = AdamConfig().build_weight_decay_mask()(tiny)
    assert jax.tree.structure(mask) == jax.tree.structure(
        jax.tree.map(lambda _: False, tiny, is_leaf=hax.is_named_array)
    )


def test_weight_decay_modules_select_by_path(tiny):
    only_regex = AdamConfig(weight_decay_modules=r"^embed\.|head\.bias$")
    assert decayed_paths(only_regex, tiny) == {"embed.weight", "head.bias"}

    names = AdamConfig(weight_decay_modules=["ln"])
    assert decayed_paths(names, tiny) == {"block.ln.weight", "block.ln.bias"}

    union = AdamConfig(weight_decay_modules=["ln"], default_weight_decay_mask=True)
    assert decayed_paths(union, tiny) == {"block.ln.weight", "block.ln.bias", "block.attn.weight", "head.weight"}


def test_no_mask_decays_everything():
    assert AdamConfig(default_weight_decay_mask=False).build_weight_decay_mask() is None


# -- skip_bad_steps ------------------------------------------------------------------------------

NORMAL_LOSSES = [1.0, 1.2, 0.9, 1.1]
NORMAL_SCALES = [1.0, 1.3, 0.8, 1.1]  # gradient norms of the normal steps
DIRECTION = jnp.array([0.6, 0.8, 0.0])  # unit norm


def skip_step_optimizer(**skip):
    config = AdamConfig(learning_rate=0.1, warmup=0, weight_decay=0.0, max_grad_norm=None, skip_bad_steps=skip)
    return config.build_for_trainer(100)


def fill_window(opt, params):
    """Four normal steps from a fresh state; returns the state."""
    state = opt.init(params)
    for loss, scale in zip(NORMAL_LOSSES, NORMAL_SCALES):
        _, state = opt.update({"w": scale * DIRECTION}, state, params, loss=jnp.asarray(loss))
    return state


@pytest.mark.parametrize(
    "value, expected",
    [
        (False, None),
        (None, None),
        (True, SkipStepConfig()),
        (16, SkipStepConfig(rolling_interval_length=16)),
        ({"sigma_factor": 3}, SkipStepConfig(sigma_factor=3.0)),
    ],
)
def test_skip_bad_steps_accepts_the_documented_forms(value, expected):
    assert AdamConfig(skip_bad_steps=value).skip_bad_steps == expected
    assert AdamConfig().skip_bad_steps is None  # off by default


@pytest.mark.parametrize(
    "value, message",
    [
        ("yes", r"optimizer\.skip_bad_steps .*expected false, true, a window length"),
        (1, r"optimizer\.skip_bad_steps\.rolling_interval_length .*greater than or equal to 2 \(got 1\)"),
        ({"window": 8}, r"optimizer\.skip_bad_steps\.window .*unknown field"),
    ],
)
def test_bad_skip_bad_steps_values_name_the_field(tmp_path, value, message):
    from levanter_core.config.loader import Sources
    from levanter_core.config.train import validate_train_config

    raw = {
        "data": {"type": "python_stdlib", "tokenizer": "byte", "cache_dir": str(tmp_path)},
        "model": {"type": "gpt2"},
        "optimizer": {"skip_bad_steps": value},
    }
    with pytest.raises(ConfigError, match=message):
        validate_train_config(raw, Sources("run.yaml"))


def test_a_spike_in_loss_or_grad_norm_is_skipped_once_the_window_has_enough_steps():
    opt = skip_step_optimizer(rolling_interval_length=4, sigma_factor=3.0)
    params = {"w": jnp.ones(3)}
    state = fill_window(opt, params)

    def step(loss, grads, state):
        updates, new_state = opt.update({"w": grads}, state, params, loss=jnp.asarray(loss))
        return updates["w"], new_state, int(skipped_step(state, new_state))

    for loss, grads in [(50.0, DIRECTION), (1.0, 100 * DIRECTION), (jnp.nan, DIRECTION), (1.0, jnp.inf * DIRECTION)]:
        updates, after, skipped = step(loss, grads, state)
        assert skipped == 1
        np.testing.assert_array_equal(updates, 0.0)  # the parameters do not move
        for x, y in zip(jax.tree.leaves(after.inner_state), jax.tree.leaves(state.inner_state)):
            np.testing.assert_array_equal(x, y)  # Adam's moments and count are untouched

    updates, after, skipped = step(1.05, 1.05 * DIRECTION, state)
    assert skipped == 0
    # the same update as Adam without skip-step, given the same normal steps
    adam = AdamConfig(learning_rate=0.1, warmup=0, weight_decay=0.0, max_grad_norm=None).build(100)
    adam_state = adam.init(params)
    for scale in NORMAL_SCALES + [1.05]:
        expected, adam_state = adam.update({"w": scale * DIRECTION}, adam_state, params)
    np.testing.assert_array_equal(updates, expected["w"])
    assert np.all(updates[:2] != 0)


def test_skipped_and_taken_steps_enter_the_window_but_non_finite_ones_do_not():
    opt = skip_step_optimizer(rolling_interval_length=4, sigma_factor=3.0)
    params = {"w": jnp.ones(3)}
    state = fill_window(opt, params)
    _, spiked = opt.update({"w": DIRECTION}, state, params, loss=jnp.asarray(50.0))
    assert int(spiked.recorded) == 5 and int(spiked.skipped) == 1
    assert 50.0 in np.asarray(spiked.losses)  # overwrote the oldest value
    _, after_nan = opt.update({"w": DIRECTION}, spiked, params, loss=jnp.asarray(jnp.nan))
    np.testing.assert_array_equal(after_nan.losses, spiked.losses)
    assert int(after_nan.recorded) == 5 and int(after_nan.skipped) == 2


def test_no_step_is_skipped_before_the_window_has_enough_steps():
    opt = skip_step_optimizer(rolling_interval_length=8, sigma_factor=3.0)  # needs 4 recorded steps
    params = {"w": jnp.ones(3)}
    three = opt.init(params)
    for loss, scale in zip(NORMAL_LOSSES[:3], NORMAL_SCALES[:3]):
        _, three = opt.update({"w": scale * DIRECTION}, three, params, loss=jnp.asarray(loss))
    four = fill_window(opt, params)

    updates, after = opt.update({"w": DIRECTION}, three, params, loss=jnp.asarray(50.0))
    assert int(after.skipped) == 0 and np.all(updates["w"][:2] != 0)
    _, after = opt.update({"w": DIRECTION}, four, params, loss=jnp.asarray(50.0))
    assert int(after.skipped) == 1


def test_skip_step_needs_the_loss():
    opt = skip_step_optimizer()
    params = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="skip_bad_steps needs the loss"):
        opt.update({"w": DIRECTION}, opt.init(params), params)


def test_without_skip_bad_steps_the_optimizer_ignores_the_loss():
    opt = AdamConfig(learning_rate=0.1, warmup=0, weight_decay=0.0).build_for_trainer(10)
    params = {"w": jnp.ones(3)}
    state = opt.init(params)
    assert skipped_step(state, state) is None
    with_loss, _ = opt.update({"w": DIRECTION}, state, params, loss=jnp.asarray(1e9))
    plain, _ = (
        AdamConfig(learning_rate=0.1, warmup=0, weight_decay=0.0).build(10).update({"w": DIRECTION}, state, params)
    )
    np.testing.assert_array_equal(with_loss["w"], plain["w"])


# -- skip_bad_steps in the trainer, across a checkpoint ---------------------------------------------

Pos = hax.Axis("position", 16)


def test_the_trainer_skips_a_spike_and_a_checkpoint_keeps_the_window(tmp_path):
    from levanter_core.checkpoint import load_checkpoint, write_checkpoint
    from levanter_core.trainer.config import TrainerConfig
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer

    config = TrainerConfig(train_batch_size=8, num_train_steps=100)
    optimizer = AdamConfig(
        learning_rate=0.01,
        warmup=0,
        lr_schedule="constant",
        weight_decay=0.0,
        skip_bad_steps={"rolling_interval_length": 8, "sigma_factor": 3.0},
    ).build_for_trainer(config.num_train_steps)
    trainer = Trainer(config, optimizer, distance_loss, mesh=make_mesh(config))

    def model_init(key):
        return Centre(hax.random.normal(key, (Embed,)))

    key = jax.random.PRNGKey(0)
    rng = np.random.default_rng(0)
    spike = np.full((8, Pos.size), 1000)
    state = trainer.init_state(model_init, key)
    for _ in range(6):
        state, metrics = trainer.train_step(state, rng.integers(0, 10, (8, Pos.size)))
        assert int(metrics["optim/skipped_step"]) == 0
    write_checkpoint(state, str(tmp_path / "step-6"), step=6)

    def host(tree):
        return [np.asarray(x) for x in jax.tree.leaves(tree)]

    before = host((state.model, state.opt_state.inner_state))
    state, metrics = trainer.train_step(state, spike)
    assert int(metrics["optim/skipped_step"]) == 1 and float(metrics["train/loss"]) > 1e5
    assert int(state.step) == 7  # the step still counts: the next batch is the next one
    for x, y in zip(before, host((state.model, state.opt_state.inner_state))):
        np.testing.assert_array_equal(x, y)
    w = np.asarray(state.model.w.array)
    state, metrics = trainer.train_step(state, rng.integers(0, 10, (8, Pos.size)))
    assert int(metrics["optim/skipped_step"]) == 0 and not np.allclose(state.model.w.array, w)

    # Resumed from step 6, the window is back: the spike is skipped again, whereas a fresh
    # state, with an empty window, would take it.
    resumed = load_checkpoint(trainer.state_template(model_init, key), str(tmp_path / "step-6"))
    assert int(resumed.opt_state.recorded) == 6
    _, metrics = trainer.train_step(resumed, spike)
    assert int(metrics["optim/skipped_step"]) == 1
    _, metrics = trainer.train_step(trainer.init_state(model_init, key), spike)
    assert int(metrics["optim/skipped_step"]) == 0
