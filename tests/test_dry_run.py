"""`levanter train CONFIG --dry-run`: check the config and print it resolved, touching neither
data nor devices nor the disk."""

import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, code_docs, run_cli, run_config, write_jsonl

# Runs the CLI in this process, then reports on stderr whether JAX ever started a backend.
DRY_RUN = """\
import sys
from levanter_core.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
from jax._src import xla_bridge
print(f"exit={code} jax_backends_initialized={xla_bridge.backends_are_initialized()}", file=sys.stderr)
"""


def tiny_config(tmp_path, **trainer) -> str:
    """A tiny run's config in tmp_path, with its data, and an empty ``home`` for :func:`dry_run`."""
    (tmp_path / "home").mkdir()
    data = {
        "type": "url",
        "train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(20))],
        "cache_dir": str(tmp_path / "cache"),
        "tokenizer": "byte",
    }
    return run_config(tmp_path, data, run_id="dry", **trainer)


def dry_run(tmp_path, *args):
    """`levanter train ARGS --dry-run` from tmp_path, with HOME in tmp_path (so that a
    compilation cache or any other file written under it would show)."""
    return subprocess.run(
        [sys.executable, "-c", DRY_RUN, "train", *args, "--dry-run"],
        cwd=tmp_path,
        env={**os.environ, "HOME": str(tmp_path / "home"), "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_dry_run_prints_the_resolved_config_and_touches_nothing(tmp_path):
    config = tiny_config(tmp_path)
    before = sorted(os.listdir(tmp_path))
    result = dry_run(tmp_path, config, "--trainer.num_train_steps", "7")
    assert "exit=0 jax_backends_initialized=False" in result.stderr, result.stderr
    resolved = yaml.safe_load(result.stdout)
    # Every section with its defaults filled in and every plugin type resolved, overrides applied.
    assert resolved["trainer"]["num_train_steps"] == 7
    assert resolved["model"]["type"] == "gpt2" and resolved["model"]["num_layers"] == 1
    assert "mlp_scale" in resolved["model"]  # a default of the gpt2 plugin's config
    assert resolved["optimizer"]["type"] == "adam" and resolved["optimizer"]["beta2"] == 0.95
    assert resolved["trainer"]["checkpointer"]["type"] == "tensorstore"
    assert [t["type"] for t in resolved["trainer"]["tracker"]] == ["json"]
    assert resolved["data"]["tokenizer"] == "byte" and resolved["data"]["format"]["type"] == "text"
    # No cache, run directory, checkpoint or compilation cache: nothing new at all.
    assert sorted(os.listdir(tmp_path)) == before
    assert os.listdir(tmp_path / "home") == []
    for written in ("cache", "logs", "ckpt"):
        assert not (tmp_path / written).exists()

    # The printed config is itself a config, which resolves to the same.
    (tmp_path / "resolved.yaml").write_text(result.stdout)
    again = dry_run(tmp_path, str(tmp_path / "resolved.yaml"))
    assert "exit=0" in again.stderr, again.stderr
    assert yaml.safe_load(again.stdout) == resolved


def test_dry_run_of_a_bad_config_exits_2_with_the_message(tmp_path):
    config = tiny_config(tmp_path)
    result = dry_run(tmp_path, config, "--model.type", "gtp2", "--optimizer.learning_rat", "1")
    assert "exit=2 jax_backends_initialized=False" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert "model.type" in result.stderr and "'gtp2'" in result.stderr and "gpt2" in result.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "cache").exists()


def test_dry_run_is_in_the_help():
    result = run_cli("train", "--help")
    assert result.returncode == 0, result.stderr
    assert "--dry-run" in result.stdout


# -- what the real run would refuse, the dry run refuses too -------------------------------------


def _bad(tmp_path, case: str) -> str:
    """A tiny run's config in tmp_path with one thing wrong that only shows when the run starts."""
    good = {
        "type": "url",
        "train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(20))],
        "cache_dir": str(tmp_path / "cache"),
        "tokenizer": "byte",
    }
    (tmp_path / "home").mkdir(exist_ok=True)
    if case == "missing-train-file":
        return run_config(tmp_path, {**good, "train_urls": [str(tmp_path / "missing.jsonl")]}, run_id="dry")
    if case == "missing-validation-file":
        return run_config(tmp_path, {**good, "validation_urls": [str(tmp_path / "val-*.jsonl")]}, run_id="dry")
    if case == "tokenizer-not-a-tokenizer":
        return run_config(tmp_path, {**good, "tokenizer": good["train_urls"][0]}, run_id="dry")
    if case == "batch-over-microbatches":
        return run_config(tmp_path, good, run_id="dry", train_batch_size=6, per_device_parallelism=4)
    if case == "batch-over-replicas":
        return run_config(tmp_path, good, run_id="dry", train_batch_size=6, replica_ici_axis_size=4)
    if case == "schedule-over-microbatches":
        stages = [{"start": 0, "value": 8}, {"start": 3, "value": 12}]
        return run_config(tmp_path, good, run_id="dry", train_batch_size=stages, per_device_parallelism=8)
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, field",
    [
        ("missing-train-file", "data.train_urls[0]"),
        ("missing-validation-file", "data.validation_urls[0]"),
        ("tokenizer-not-a-tokenizer", "data.tokenizer"),
        ("batch-over-microbatches", "trainer.per_device_parallelism"),
        ("batch-over-replicas", "trainer.replica_ici_axis_size"),
        ("schedule-over-microbatches", "trainer.train_batch_size"),
    ],
)
def test_the_checks_of_a_real_run_are_made_before_it_starts(tmp_path, case, field):
    from levanter_core.config.train import load_train_config
    from levanter_core.errors import UserError
    from levanter_core.run import preflight

    config, _ = load_train_config(_bad(tmp_path, case))
    with pytest.raises(UserError) as e:
        preflight(config)
    assert field in str(e.value), str(e.value)
    assert e.value.exit_code == 2
    assert not (tmp_path / "logs").exists() and not (tmp_path / "cache").exists()


def test_a_dry_run_stops_on_a_missing_data_file_without_touching_devices(tmp_path):
    result = dry_run(tmp_path, _bad(tmp_path, "missing-train-file"))
    assert "exit=2 jax_backends_initialized=False" in result.stderr, result.stderr
    assert "data.train_urls[0]" in result.stderr and "missing.jsonl" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "logs").exists() and not (tmp_path / "cache").exists()
