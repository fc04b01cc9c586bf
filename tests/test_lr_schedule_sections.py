"""``optimizer.lr_schedule`` as a section, as Levanter writes it: ``{type: cosine, exponent: 2}``,
``{type: power, batch_size: ..., seq_length: ..., a: ..., b: ...}``, ``{type: inv_sqrt, timescale: ...}``
and the other shapes by name or as sections."""

import math
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from levanter_core.config.base import validate_section
from levanter_core.config.loader import load_yaml
from levanter_core.config.reference import iter_fields
from levanter_core.config.train import load_train_config
from levanter_core.errors import ConfigError
from levanter_core.optim import AdamConfig
from levanter_core.optim.schedule import CosineSchedule, PowerSchedule

PEAK = 1.0
MIN_RATIO = 0.1
WARMUP = 10
STEPS = 100
DECAY = STEPS - WARMUP


def lrs(lr_schedule, steps, *, num_train_steps=STEPS, **fields) -> np.ndarray:
    config = AdamConfig(**{"learning_rate": PEAK, "warmup": WARMUP, "lr_schedule": lr_schedule, **fields})
    schedule = config.lr_scheduler(num_train_steps)
    return np.array([float(schedule(step)) for step in steps])


# -- values against the formulas --------------------------------------------------------------


@pytest.mark.parametrize("exponent", [0.5, 2.0, 3.0])
def test_cosine_exponent_raises_the_cosine_factor_between_peak_and_min(exponent):
    steps = [10, 25, 40, 55, 70, 85, 99, 100, 120]
    got = lrs({"type": "cosine", "exponent": exponent}, steps)
    p = np.minimum(np.array(steps) - WARMUP, DECAY) / DECAY
    expected = MIN_RATIO + (PEAK - MIN_RATIO) * (0.5 * (1 + np.cos(np.pi * p))) ** exponent
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    # the same as optax's cosine_decay_schedule with that exponent, over the decay phase
    reference = optax.cosine_decay_schedule(PEAK, DECAY, MIN_RATIO, exponent)
    np.testing.assert_allclose(got, [float(reference(s - WARMUP)) for s in steps], rtol=1e-5, atol=1e-7)
    # halfway through the decay the plain cosine is at the middle; a higher power is lower
    middle = lrs({"type": "cosine", "exponent": exponent}, [55])[0]
    assert middle == pytest.approx(MIN_RATIO + (PEAK - MIN_RATIO) * 0.5**exponent, rel=1e-5)


def test_cosine_exponent_one_and_the_named_shapes_equal_the_plain_names_bit_for_bit():
    steps = range(121)
    for name, section in [
        ("cosine", {"type": "cosine", "exponent": 1.0}),
        ("cosine", {"type": "cosine"}),
        ("linear", {"type": "linear"}),
        ("constant", {"type": "constant"}),
        ("inv", {"type": "inv"}),
        ("inv_sqrt", {"type": "inv_sqrt"}),
    ]:
        assert lrs(section, steps, cycles=2, rewarmup=5).tolist() == lrs(name, steps, cycles=2, rewarmup=5).tolist()


def power_law(t, *, peak, batch_size, seq_length, a, b):
    tokens = t * batch_size * seq_length
    return min(peak, batch_size * a * tokens**b) if tokens > 0 else peak


def test_power_schedule_follows_the_power_law_in_tokens_since_the_decay_started():
    section = {"type": "power", "batch_size": 8, "seq_length": 128, "a": 4.6, "b": -0.51}
    peak = 0.5
    steps = [0, 5, 10, 11, 12, 20, 50, 100]
    got = lrs(section, steps, learning_rate=peak)
    law = dict(peak=peak, batch_size=8, seq_length=128, a=4.6, b=-0.51)
    expected = [s / WARMUP * peak if s < WARMUP else power_law(s - WARMUP, **law) for s in steps]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert got[2] == peak and got[3] == peak  # capped at the peak while the law is above it
    assert got[-1] < 0.25 * peak  # and well below it later
    # min_lr_ratio plays no part
    assert lrs(section, steps, learning_rate=peak, min_lr_ratio=0.5).tolist() == got.tolist()


def test_power_schedule_starts_after_a_stable_phase():
    section = {"type": "power", "batch_size": 4, "seq_length": 256, "a": 2.0, "b": -0.6}
    got = lrs(section, [10, 60, 70, 71, 90, 100], decay=30, learning_rate=0.3)
    law = dict(peak=0.3, batch_size=4, seq_length=256, a=2.0, b=-0.6)
    np.testing.assert_allclose(got, [0.3, 0.3] + [power_law(t, **law) for t in (0, 1, 20, 30)], rtol=1e-5)


def test_power_schedule_counts_billions_of_tokens_without_overflow_and_under_jit():
    section = {"type": "power", "batch_size": 256, "seq_length": 1024, "a": 4.6, "b": -0.51}
    config = AdamConfig(learning_rate=0.02, warmup=0, lr_schedule=section)
    schedule = config.lr_scheduler(50_000)
    steps = jnp.array([1, 8_193, 20_000, 35_000, 49_999])  # 8193 steps are past 2**31 tokens
    traced = np.asarray(jax.jit(jax.vmap(schedule))(steps))
    law = dict(peak=0.02, batch_size=256, seq_length=1024, a=4.6, b=-0.51)
    np.testing.assert_allclose(traced, [power_law(int(s), **law) for s in steps], rtol=1e-5)
    assert traced[0] == np.float32(0.02) and np.all(np.diff(traced[1:]) < 0) and traced[-1] > 0.008


def test_inv_sqrt_timescale_sets_the_rate_of_fall_and_stops_at_the_minimum():
    got = lrs({"type": "inv_sqrt", "timescale": 10}, [10, 20, 40, 90, 100], min_lr_ratio=0.35)
    t = np.array([0, 10, 30, 80, 90])
    np.testing.assert_allclose(got, np.maximum(0.35, 1 / np.sqrt(1 + t / 10)), rtol=1e-6)
    assert got[1] == pytest.approx(1 / math.sqrt(2), rel=1e-6)
    assert got[-2] == got[-1] == pytest.approx(0.35)  # floored (1/sqrt(9) and 1/sqrt(10) are below)
    # with a timescale the rate never has to reach the minimum, so min_lr_ratio may be 0
    zero_floor = lrs({"type": "inv_sqrt", "timescale": 1000}, [100], min_lr_ratio=0.0)
    assert zero_floor[0] == pytest.approx(1 / math.sqrt(1 + 90 / 1000), rel=1e-6)


# -- loading ----------------------------------------------------------------------------------

CONFIG = """\
data:
  type: python_stdlib
  tokenizer: byte
  cache_dir: {cache}
model:
  type: gpt2
  hidden_dim: 32
  num_heads: 2
  num_layers: 1
  seq_len: 32
trainer:
  num_train_steps: 100
  train_batch_size: 4
optimizer:
  learning_rate: 1E-3
  warmup: 0.1
"""


def load(tmp_path, optimizer_lines: str, overrides=None):
    text = CONFIG.format(cache=tmp_path / "cache") + textwrap.indent(textwrap.dedent(optimizer_lines), "  ")
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_train_config(str(path), overrides)[0]


def test_levanter_sections_load_from_yaml(tmp_path):
    cosine = load(tmp_path, "lr_schedule:\n  type: cosine\n  exponent: 2.0\n").optimizer
    assert cosine.lr_schedule == CosineSchedule(exponent=2.0)
    power = load(tmp_path, "lr_schedule: {type: power, batch_size: 256, seq_length: 1024, a: 4.6, b: -0.51}\n")
    assert power.optimizer.lr_schedule == PowerSchedule(batch_size=256, seq_length=1024)
    defaults = load(tmp_path, "lr_schedule: {type: power, batch_size: 64, seq_length: 512}\n").optimizer.lr_schedule
    assert (defaults.a, defaults.b) == (4.6, -0.51)  # Levanter's defaults
    inv_sqrt = load(tmp_path, "lr_schedule: {type: inv_sqrt, timescale: 10000}\n").optimizer.lr_schedule
    assert inv_sqrt.timescale == 10000
    for name in ("constant", "linear", "inv"):
        assert load(tmp_path, f"lr_schedule: {{type: {name}}}\n").optimizer.lr_schedule == name


def test_a_name_still_loads_compares_and_is_written_as_before(tmp_path):
    config = load(tmp_path, "lr_schedule: linear\n", ["--optimizer.lr_schedule", "inv"])
    assert config.optimizer.lr_schedule == "inv"
    assert config.optimizer.model_dump()["lr_schedule"] == "inv"
    assert AdamConfig().model_dump()["lr_schedule"] == "cosine"
    assert AdamConfig(lr_schedule={"type": "cosine"}) == AdamConfig(lr_schedule="cosine")
    assert hash(AdamConfig(lr_schedule={"type": "cosine"})) == hash(AdamConfig())
    # a section with non-default fields is written as a section, and reloads to the same
    exponent = AdamConfig(lr_schedule={"type": "cosine", "exponent": 2})
    assert exponent.model_dump()["lr_schedule"] == {"type": "cosine", "exponent": 2.0}
    assert exponent.lr_schedule != "cosine"
    assert AdamConfig.model_validate(exponent.model_dump()) == exponent


def test_overrides_replace_the_section(tmp_path):
    config = load(tmp_path, "lr_schedule: cosine\n", ["--optimizer.lr_schedule", "{type: cosine, exponent: 3}"])
    assert config.optimizer.lr_schedule.exponent == 3.0
    config = load(tmp_path, "lr_schedule: {type: cosine}\n", ["--optimizer.lr_schedule.exponent", "0.5"])
    assert config.optimizer.lr_schedule.exponent == 0.5


POWER = "lr_schedule: {type: power, batch_size: 8, seq_length: 8, "
FIELD = r"optimizer\.lr_schedule"


@pytest.mark.parametrize(
    "lines, message",
    [
        (POWER + "a: 0}", FIELD + r"\.a .*greater than 0"),
        (POWER + "a: -1}", FIELD + r"\.a .*greater than 0"),
        (POWER + "b: 0}", FIELD + r"\.b .*less than 0"),
        (POWER + "b: 0.5}", FIELD + r"\.b .*less than 0"),
        ("lr_schedule: {type: power, seq_length: 8}", FIELD + r"\.batch_size .*required"),
        ("lr_schedule: power", FIELD + r"\.batch_size .*required"),
        ("lr_schedule: {type: power, batch_size: 0, seq_length: 8}", FIELD + r"\.batch_size .*greater than or equal"),
        ("lr_schedule: {type: cosine, exponent: 0}", FIELD + r"\.exponent .*greater than 0"),
        ("lr_schedule: {type: inv_sqrt, timescale: -5}", FIELD + r"\.timescale .*greater than 0"),
        ("lr_schedule: {type: linear, exponent: 2}", FIELD + r"\.exponent .*unknown field"),
        ("lr_schedule: {type: step}", FIELD + r" .*unknown lr_schedule type 'step'; expected one of constant, linear"),
        ("lr_schedule: {exponent: 2}", FIELD + r" .*needs a `type`"),
        ("lr_schedule: cosin", FIELD + r" .*unknown lr_schedule 'cosin'"),
        ("lr_schedule: {type: inv_sqrt}\nmin_lr_ratio: 0", r"'inv_sqrt' never reaches 0: set min_lr_ratio above 0, or"),
    ],
)
def test_bad_sections_name_the_field(tmp_path, lines, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, lines + "\n")


def test_the_reference_lists_each_shapes_fields():
    rows = {name: (type_name, default) for name, type_name, default, _ in iter_fields(AdamConfig)}
    assert rows["lr_schedule"] == ("section", "'cosine'")
    assert rows["lr_schedule[type=cosine].exponent"] == ("float", "1.0")
    assert rows["lr_schedule[type=power].batch_size"] == ("int", "required")
    assert rows["lr_schedule[type=power].b"] == ("float", "-0.51")
    assert rows["lr_schedule[type=inv_sqrt].timescale"] == ("float | null", "None")


REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "levanter-configs"


def _reference_optimizers() -> list[str]:
    if not REFERENCE.is_dir():
        return []
    return sorted(str(p.relative_to(REFERENCE)) for p in REFERENCE.rglob("*.yaml") if "lr_schedule" in p.read_text())


@pytest.mark.skipif(not _reference_optimizers(), reason=f"Levanter's configs are not at {REFERENCE}")
@pytest.mark.parametrize("relative", _reference_optimizers() or ["none"])
def test_levanters_configs_lr_schedules_load(relative):
    # Whatever program a config is for, its optimizer section must load (lr_schedule included).
    raw = load_yaml(str(REFERENCE / relative))[0]
    section = raw["optimizer"]
    config = validate_section("optimizer", {"type": "adam", **section})
    config.lr_scheduler((raw.get("trainer") or {}).get("num_train_steps", 400_000))  # Levanter's default
    assert config.lr_schedule == section["lr_schedule"]
