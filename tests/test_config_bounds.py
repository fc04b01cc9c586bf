"""Configs that would hang, overflow or crash later are refused when they load: YAML bombs
(aliases that expand without end, nesting thousands of levels deep), numbers out of the range
the run can use, booleans where a number is meant, and non-finite floats."""

import re
import time

import pytest

from conftest import run_cli
from levanter_core.config.loader import load_config_dict, parse_overrides
from levanter_core.config.train import load_train_config
from levanter_core.errors import ConfigError

BASE = """\
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
  learning_rate: 1e-3
"""


def write(tmp_path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load_error(path: str, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_train_config(path, overrides)
    return str(e.value)


# -- YAML bombs ----------------------------------------------------------------------------


def billion_laughs(levels: int = 10) -> str:
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    lines.append(f"data: {{train_urls: *a{levels - 1}}}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text, line, what",
    [
        (billion_laughs(), r"\d+", "aliases"),
        ("model:\n  x: " + "[" * 5000 + "]" * 5000 + "\n", "2", "nested"),
        ("model:\n  x:\n" + "".join("  " * (i + 2) + f"k{i}:\n" for i in range(3000)), r"\d+", "nested"),
        ("a: &a [*a]\n", "1", "refers to itself"),
    ],
    ids=["billion-laughs", "deep-flow", "deep-block", "self-alias"],
)
def test_a_yaml_bomb_is_refused_at_once_naming_the_file_and_line(tmp_path, text, line, what):
    path = write(tmp_path, text)
    # the loader's own processor time: what "at once" means, whatever else the machine runs
    start = time.thread_time()
    with pytest.raises(ConfigError) as e:
        load_config_dict(path)
    assert time.thread_time() - start < 1.0
    message = str(e.value)
    assert re.search(re.escape(path) + ":" + line, message), message
    assert what in message


def test_a_bomb_in_an_included_file_names_that_file(tmp_path):
    write(tmp_path, billion_laughs(), "bomb.yaml")
    main = write(tmp_path, "data: !include bomb.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config_dict(main)
    assert str(tmp_path / "bomb.yaml") in str(e.value)


def test_a_bomb_in_an_override_is_refused(tmp_path):
    start = time.thread_time()
    with pytest.raises(ConfigError) as e:
        parse_overrides(["--data.train_urls", "[" * 5000 + "]" * 5000])
    assert time.thread_time() - start < 1.0
    assert "--data.train_urls" in str(e.value) and "nested" in str(e.value)


def test_a_yaml_bomb_exits_2_without_a_traceback(tmp_path):
    path = write(tmp_path, "model:\n  x: " + "[" * 5000 + "]" * 5000 + "\n")
    result = run_cli("train", path, "--dry-run", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "RecursionError" not in result.stderr
    assert f"{path}:2" in result.stderr


def test_ordinary_aliases_and_nesting_still_load(tmp_path):
    text = "defaults: &d {hidden_dim: 32, num_heads: 2}\nmodel:\n  <<: *d\n  deep: " + "[" * 40 + "]" * 40 + "\n"
    data, _ = load_config_dict(write(tmp_path, text))
    assert data["model"]["hidden_dim"] == 32


# -- values out of range -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("trainer.seed", "100000000000000000000000", r"trainer\.seed .*0 to 4294967295"),
        ("trainer.seed", "-1", r"trainer\.seed .*0 to 4294967295"),
        ("trainer.seed", "4294967296", r"trainer\.seed .*0 to 4294967295"),
        ("data_seed", "1000000000000000000000000", r"data_seed .*0 to 4294967295"),
        ("trainer.num_train_steps", "1000000000000000000000000", r"trainer\.num_train_steps .*2147483647"),
        ("trainer.train_batch_size", "1000000000000", r"trainer\.train_batch_size\S* .*2147483647"),
        ("model.hidden_dim", "1000000000000", r"model\.hidden_dim .*2147483647"),
        ("model.num_layers", "true", r"model\.num_layers .*not true/false"),
        ("trainer.num_train_steps", "false", r"trainer\.num_train_steps .*not true/false"),
        ("optimizer.learning_rate", ".inf", r"optimizer\.learning_rate .*finite"),
        ("optimizer.learning_rate", ".nan", r"optimizer\.learning_rate .*finite"),
        ("optimizer.beta1", "-.inf", r"optimizer\.beta1 .*finite"),
        ("optimizer.weight_decay", "true", r"optimizer\.weight_decay .*not true/false"),
        ("optimizer.warmup", "1.0e+23", r"optimizer\.warmup .*100 steps"),
        ("optimizer.warmup", "500", r"optimizer\.warmup .*100 steps"),
        ("optimizer.decay", "0.5", None),
        ("optimizer.cooldown", "1.0e+30", r"optimizer\.cooldown"),
    ],
)
def test_a_value_the_run_cannot_use_is_refused_with_the_allowed_range(tmp_path, field, value, expected):
    path = write(tmp_path, BASE.format(cache=tmp_path / "cache"))
    overrides = [f"--{field}", value]
    if expected is None:  # the same phases that fit together are fine
        load_train_config(path, overrides)
        return
    message = load_error(path, overrides)
    assert re.search(expected, message), message
    assert "command line" in message


def test_warmup_and_decay_that_do_not_fit_the_run_are_refused(tmp_path):
    path = write(tmp_path, BASE.format(cache=tmp_path / "cache"))
    message = load_error(path, ["--optimizer.warmup", "0.6", "--optimizer.decay", "0.6"])
    assert "optimizer" in message and "warmup" in message and "decay" in message


def test_values_at_the_edge_of_the_range_load(tmp_path):
    path = write(tmp_path, BASE.format(cache=tmp_path / "cache"))
    config, _ = load_train_config(
        path, ["--trainer.seed", "4294967295", "--trainer.num_train_steps", "2147483647", "--data_seed", "0"]
    )
    assert config.trainer.seed == 2**32 - 1 and config.trainer.num_train_steps == 2**31 - 1


def test_a_union_with_bool_still_takes_booleans(tmp_path):
    path = write(tmp_path, BASE.format(cache=tmp_path / "cache"))
    config, _ = load_train_config(path, ["--data.shuffle", "true", "--optimizer.skip_bad_steps", "true"])
    assert config.data.shuffle is True and config.optimizer.skip_bad_steps is not None


def test_token_and_byte_counts_take_64_bit_numbers(tmp_path):
    path = write(tmp_path, BASE.format(cache=tmp_path / "cache"))
    budgets = ["--data.target_budget", "300000000000", "--data.experiment_budget", "3000000000"]
    config, _ = load_train_config(path, [*budgets, "--data.cache_options.target_size_per_flush", "4000000000"])
    assert config.data.target_budget == 300_000_000_000
    assert config.data.cache_options.target_bytes_per_flush == 4_000_000_000
