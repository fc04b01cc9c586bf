"""Loading configs: the guide's YAML format, includes, overrides, and every kind of bad config."""

import datetime
import textwrap

import pytest

from conftest import run_cli
from levanter_core.config.loader import load_config_dict
from levanter_core.config.train import TrainConfig, load_train_config
from levanter_core.errors import ConfigError

GOOD = """\
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
  mp: p=f32,c=bfloat16
  num_train_steps: 10
  train_batch_size: 4
  checkpointer:
    save_interval: 5m
    keep:
      - every: 1000
        until: 10000
      - every: 5000
optimizer:
  learning_rate: 6E-4
  weight_decay: 0.1
"""


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def load_error(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_train_config(path, overrides)
    return str(e.value)


@pytest.fixture
def good(tmp_path):
    return write(tmp_path, GOOD.format(cache=tmp_path / "cache"))


def test_the_guides_format_loads_with_defaults(good):
    config, _ = load_train_config(good)
    assert isinstance(config, TrainConfig)
    assert config.model.type == "gpt2" and config.model.hidden_dim == 32
    assert config.trainer.mp == "p=f32,c=bfloat16"
    assert config.trainer.checkpointer.save_interval == datetime.timedelta(minutes=5)
    assert [(k.every, k.until) for k in config.trainer.checkpointer.keep] == [(1000, 10000), (5000, None)]
    assert config.optimizer.type == "adam" and config.optimizer.learning_rate == 6e-4
    assert [t.type for t in config.trainer.tracker] == ["json"]  # the default tracker
    assert config.trainer.checkpointer.type == "tensorstore"
    assert config.trainer.steps_per_eval == 1000  # the guide's default


def test_resolved_config_round_trips(good):
    config, _ = load_train_config(good)
    dumped = config.model_dump(mode="json")
    assert dumped["trainer"]["checkpointer"]["save_interval"] == "5m"
    assert dumped["model"]["type"] == "gpt2"
    assert TrainConfig.model_validate(dumped) == config


def test_include_is_relative_to_the_including_file(tmp_path):
    sub = tmp_path / "parts"
    sub.mkdir()
    write(sub, "type: python_stdlib\ntokenizer: byte\ncache_dir: /tmp/x\n", "data.yaml")
    main = write(
        tmp_path,
        GOOD.split("model:")[0].replace(
            "data:\n  type: python_stdlib\n  tokenizer: byte\n  cache_dir: {cache}\n",
            "data: !include parts/data.yaml\n",
        )
        + "model:"
        + GOOD.split("model:")[1].format(cache=""),
    )
    config, _ = load_train_config(main)
    assert config.data.configs["main"].type == "python_stdlib" and config.data.cache_dir == "/tmp/x"


def test_overrides_set_nested_fields_with_yaml_values(good):
    config, _ = load_train_config(
        good,
        [
            "--trainer.num_train_steps",
            "123",
            "--model.hidden_dim=64",
            "--trainer.tracker",
            '[{"type": "json"}, {"type": "noop"}]',
            "--trainer.checkpointer.keep.0.every",
            "7",
            "--optimizer.lr_schedule",
            "linear",
        ],
    )
    assert config.trainer.num_train_steps == 123
    assert config.model.hidden_dim == 64
    assert [t.type for t in config.trainer.tracker] == ["json", "noop"]
    assert config.trainer.checkpointer.keep[0].every == 7
    assert config.optimizer.lr_schedule == "linear"


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "model:\n  type: gpt2\n  hidden_dim: [1, 2\ntrainer: {}\n")
    message = load_error(path)
    assert path in message and "invalid YAML" in message
    assert ":4:" in message or ":3:" in message


def test_unknown_key_names_the_dotted_field_line_and_a_suggestion(good, tmp_path):
    text = open(good).read().replace("  num_train_steps: 10", "  num_train_step: 10")
    path = write(tmp_path, text, "typo.yaml")
    message = load_error(path)
    assert "trainer.num_train_step" in message
    assert f"{path}:13" in message
    assert "did you mean 'num_train_steps'" in message


def test_unknown_key_inside_a_plugin_section(good, tmp_path):
    path = write(tmp_path, open(good).read().replace("  num_layers: 1", "  num_layer: 1"), "m.yaml")
    message = load_error(path)
    assert "model.num_layer" in message and "did you mean 'num_layers'" in message


def test_wrong_value_type_names_the_field_and_the_value(good):
    message = load_error(good, ["--trainer.train_batch_size", "lots"])
    assert "trainer.train_batch_size" in message and "'lots'" in message
    assert "command line --trainer.train_batch_size" in message


def test_unknown_type_lists_installed_choices_and_distributions(good):
    message = load_error(good, ["--model.type", "gpt3"])
    assert "model.type" in message and "'gpt3'" in message
    assert "gpt2 (levanter-model-gpt2" in message


def test_unknown_tracker_type_in_a_list(good):
    message = load_error(good, ["--trainer.tracker", '[{"type": "json"}, {"type": "nope"}]'])
    assert "trainer.tracker.1.type" in message and "json (levanter-core" in message


def test_missing_model_type_lists_choices(good, tmp_path):
    path = write(tmp_path, open(good).read().replace("  type: gpt2\n", ""), "nomodel.yaml")
    message = load_error(path)
    assert "model.type" in message and "gpt2 (levanter-model-gpt2" in message


def test_missing_config_file(tmp_path):
    message = load_error(str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in message and "does not exist" in message


def test_missing_include(tmp_path):
    path = write(tmp_path, "data: !include missing.yaml\n")
    message = load_error(path)
    assert "missing.yaml" in message and f"{path}:1" in message


def test_duplicate_key_is_an_error(tmp_path):
    path = write(tmp_path, "trainer:\n  seed: 1\n  seed: 2\n")
    assert "appears twice" in load_error(path)


def test_bad_duration_and_bad_precision(good):
    message = load_error(good, ["--trainer.checkpointer.save_interval", "soon"])
    assert "trainer.checkpointer.save_interval" in message and "'30s'" in message
    message = load_error(good, ["--trainer.mp", "p=f33"])
    assert "trainer.mp" in message and "p=f32,c=bfloat16" in message


def test_override_syntax_errors(good):
    assert "--section.field VALUE" in load_error(good, ["oops"])
    assert "needs a value" in load_error(good, ["--trainer.seed"])


def test_loader_keeps_key_positions(good):
    _, sources = load_config_dict(good)
    assert sources.place_of(("trainer", "num_train_steps")) == f"{good}:13"


def test_cli_bad_config_exits_2_with_one_message_and_no_traceback(good):
    result = run_cli("train", good, "--model.type", "gpt3")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "model.type" in result.stderr and "gpt2 (levanter-model-gpt2" in result.stderr
    assert result.stdout == ""


def test_cli_missing_file_exits_2(tmp_path):
    result = run_cli("train", str(tmp_path / "absent.yaml"))
    assert result.returncode == 2 and "absent.yaml" in result.stderr and "Traceback" not in result.stderr


def test_train_help_explains_every_field():
    result = run_cli("train", "--help")
    assert result.returncode == 0
    for field in (
        "trainer.num_train_steps",
        "trainer.per_device_parallelism",
        "optimizer[type=adam].learning_rate",
        "model[type=gpt2].hidden_dim",
        "trainer.checkpointer[type=tensorstore].save_interval",
    ):
        assert field in result.stdout, field
    assert "Sequences per optimizer step" in result.stdout


MIXTURE = """\
data:
  tokenizer: byte
  cache_dir: {cache}
  configs:
    code:
      type: python_stdlib
    web:
      train_urls: ["web/{{1..4}}.jsonl"]
      format: {{type: chat}}
  train_weights: {weights}
model:
  type: gpt2
"""


def test_a_mixture_loads_and_round_trips(tmp_path):
    path = write(
        tmp_path, MIXTURE.format(cache=tmp_path / "cache", weights="[[0, {code: 1}], [100, {code: 1, web: 3}]]")
    )
    config, _ = load_train_config(path)

    assert config.data.is_mixture and list(config.data.configs) == ["code", "web"]
    assert config.data.configs["web"].format.type == "chat"
    assert config.data.weight_stages() == [(0, {"code": 1.0, "web": 0.0}), (100, {"code": 0.25, "web": 0.75})]
    assert config.data.cache_path("web", "train") == f"{tmp_path}/cache/web/train"
    dumped = config.model_dump(mode="json")
    assert TrainConfig.model_validate(dumped) == config


def test_a_single_source_is_written_back_inline(good):
    config, _ = load_train_config(good)
    data = config.model_dump(mode="json")["data"]
    assert data["type"] == "python_stdlib" and "configs" not in data
    assert config.data.cache_path("main", "train").endswith("/cache/train")


@pytest.mark.parametrize(
    "weights, expected",
    [
        ("{code: 1, wiki: 1}", "train_weights names wiki, not among data.configs (code, web)"),
        ("{code: 0, web: 0}", "no source has a positive weight"),
        ("[[5, {code: 1}]]", "must start at step 0"),
        ("{code: 1, web: 0.0001}", "'web' would get 0.2 of every 2048 sequences"),
    ],
)
def test_bad_mixture_weights_are_explained(tmp_path, weights, expected):
    path = write(tmp_path, MIXTURE.format(cache=tmp_path / "cache", weights=weights))
    assert expected in load_error(path)


def test_source_fields_beside_configs_are_pointed_to_their_place(tmp_path):
    text = MIXTURE.format(cache=tmp_path / "cache", weights="{code: 1}").replace(
        "  configs:", "  train_urls: [a.jsonl]\n  configs:"
    )
    message = load_error(write(tmp_path, text))
    assert "data.train_urls" in message and "go under data.configs.<name>" in message


def test_typos_in_the_data_section_get_suggestions(good, tmp_path):
    message = load_error(good, ["--data.max_filez", "3"])
    assert "data.max_filez" in message and "did you mean 'max_files'?" in message
    text = MIXTURE.format(cache=tmp_path / "cache", weights="{code: 1}").replace(
        "      type: python_stdlib", "      type: python_stdlib\n      max_filez: 3"
    )
    message = load_error(write(tmp_path, text, "typo.yaml"))
    assert "data.configs.code.max_filez" in message and "did you mean 'max_files'?" in message


def test_an_unknown_format_type_lists_the_formats(good):
    message = load_error(good, ["--data.format", "{type: markdown}"])
    assert "data.format" in message and "chat" in message and "supervised" in message


def test_train_batch_size_minus_one_needs_a_per_device_size(good):
    """Levanter's ``train_batch_size: -1``: ``per_device_parallelism`` sequences on each data-parallel
    device, worked out when the run starts (``TrainerConfig.for_devices``)."""
    config, _ = load_train_config(good, ["--trainer.train_batch_size", "-1", "--trainer.per_device_parallelism", "3"])
    assert config.trainer.for_devices(4).train_batch_size == 12
    with pytest.raises(ConfigError, match="train_batch_size -1 means per_device_parallelism"):
        load_train_config(good, ["--trainer.train_batch_size", "-1"])
    with pytest.raises(ConfigError, match="must be a positive number of sequences"):
        load_train_config(good, ["--trainer.train_batch_size", "-2"])


def test_levanters_heads_tensor_parallelism_splits_kv_heads_too():
    """Levanter's ``tensor_parallel_axes: [mlp, heads]`` on a grouped-query attention model (whose
    head axis is ``kv_heads``) shards the heads, as it means in Levanter."""
    from levanter_core.trainer.config import TrainerConfig

    config = TrainerConfig(tensor_parallel_axes=["mlp", "heads"])
    assert config.compute_axis_mapping()["kv_heads"] == config.parameter_axis_mapping()["heads"] == "model"
    assert "kv_heads" not in TrainerConfig(tensor_parallel_axes=["mlp"]).compute_axis_mapping()
    kept = TrainerConfig(tensor_parallel_axes=["heads"], axis_resources={"kv_heads": "data"})
    assert kept.compute_axis_mapping()["kv_heads"] == "data"  # an explicit mapping wins
