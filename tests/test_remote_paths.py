"""A path on an object store (``gs://``, ``s3://``...) whose fsspec filesystem package is not
installed stops the run when the config is loaded, with one message per field naming the
field, its file and line, the URL scheme and what to ``pip install``; not seconds into the
run, after the cache build started."""

import pytest
import yaml
from blocked_imports import env_without

from conftest import run_cli
from levanter_core.config.train import load_train_config
from levanter_core.errors import ConfigError
from levanter_core.fileio import require_filesystem

GCS_HINT = "gs:// paths need the gcsfs package, which is not installed: pip install 'levanter-core[gcs]'"
S3_HINT = "s3:// paths need the s3fs package, which is not installed: pip install 'levanter-core[s3]'"


def _write(tmp_path, config: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def _lines_of(result) -> list[str]:
    return [line.strip() for line in result.stderr.splitlines()]


def _line_of(path: str, key: str) -> int:
    """The line (from 1) where ``key:`` is written in the YAML file at ``path``."""
    with open(path) as f:
        return next(i for i, line in enumerate(f, 1) if line.strip().startswith(f"{key}:"))


def test_object_store_paths_without_their_package_stop_the_run_at_load(tmp_path):
    local = tmp_path / "train.jsonl"
    local.write_text('{"text": "x"}\n')
    config = _write(
        tmp_path,
        {
            "data": {
                "train_urls": [str(local), "gs://bucket/web/train-{1..8}.jsonl.gz"],
                "validation_urls": ["s3://bucket/web/valid.jsonl"],
                "tokenizer": "byte",
                "cache_dir": str(tmp_path / "cache"),
            },
            "model": {"type": "gpt2", "hidden_dim": 32, "num_heads": 2, "num_layers": 1, "seq_len": 64},
            "trainer": {
                "num_train_steps": 2,
                "log_dir": str(tmp_path / "logs"),
                "checkpointer": {"base_path": "gs://bucket/checkpoints"},
            },
        },
    )
    result = run_cli("train", config, "--no-progress", env=env_without(["gcsfs", "s3fs"], tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = _lines_of(result)
    # Each field with its place in the file.
    for field, hint in [
        ("data.train_urls", GCS_HINT),
        ("data.validation_urls", S3_HINT),
        ("trainer.checkpointer.base_path", GCS_HINT),
    ]:
        where = f"{config}:{_line_of(config, field.rsplit('.', 1)[1])}"
        assert any(line.startswith(f"{field} ({where}): {hint}") for line in lines), result.stderr
    # Stopped before anything was read or written.
    assert not (tmp_path / "cache").exists() and not (tmp_path / "logs").exists()


def test_a_mixture_sources_own_cache_dir_is_checked_too(tmp_path):
    config = _write(
        tmp_path,
        {
            "data": {
                "tokenizer": "byte",
                "configs": {"web": {"train_urls": ["web.jsonl"], "cache_dir": "s3://bucket/cache/web"}},
                "train_weights": {"web": 1.0},
            },
            "model": {"type": "gpt2"},
        },
    )
    result = run_cli("train", config, "--dry-run", env=env_without(["s3fs"], tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"data.configs.web.cache_dir ({config}:{_line_of(config, 'cache_dir')}): {S3_HINT}" in result.stderr


def test_an_unknown_scheme_is_named():
    with pytest.raises(ValueError, match=r"fsspec has no filesystem for gss:// URLs"):
        require_filesystem("gss://bucket/checkpoints")


def test_local_paths_and_installed_filesystems_pass():
    for path in [
        None,
        "checkpoints/",
        "/abs/path",
        "~/data/*.jsonl",
        "file:///tmp/x",
        "memory://cache",
        "https://x/a.jsonl",
    ]:
        assert require_filesystem(path) == path


def test_an_installed_object_store_filesystem_passes(tmp_path):
    pytest.importorskip("gcsfs")
    config = _write(
        tmp_path, {"data": {"train_urls": ["gs://bucket/a.jsonl"], "tokenizer": "byte"}, "model": {"type": "gpt2"}}
    )
    loaded, _ = load_train_config(config)
    assert loaded.data.configs[next(iter(loaded.data.configs))].train_urls == ("gs://bucket/a.jsonl",)


def test_a_chained_url_is_checked_link_by_link():
    with pytest.raises(ValueError, match="fsspec has no filesystem for nosuch://"):
        require_filesystem("simplecache::nosuch://bucket/a.jsonl")
    assert require_filesystem("simplecache::memory://a.jsonl") == "simplecache::memory://a.jsonl"


def test_in_process_the_error_is_a_config_error_naming_the_field(tmp_path):
    config = _write(tmp_path, {"data": {"train_urls": ["gss://typo/a.jsonl"]}, "model": {"type": "gpt2"}})
    with pytest.raises(ConfigError, match=r"data\.train_urls \(.*run\.yaml:2\): fsspec has no filesystem for gss://"):
        load_train_config(config)
