"""The W&B tracker, offline: what it writes is read back from the run's ``.wandb`` file
(what ``wandb sync`` would upload) and checked against what was logged."""

import json
import os
import subprocess

import numpy as np
import pytest
from pydantic import ValidationError

import levanter_tracker_wandb.plugin as wandb_plugin
from levanter_core import plugins
from levanter_core.config.base import validate_section
from levanter_core.testing import code_docs, run_config, write_jsonl
from levanter_core.tracker import Histogram, RunInfo
from levanter_tracker_wandb.offline import offline_run_files, read_offline_run


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, with its settings, caches and staging under tmp_path: nothing reaches the
    network or the home directory."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    for var, sub in [("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data")]:
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)


@pytest.fixture
def wandb_only():
    plugins.reset(autoload=False)
    plugins.register_plugin(wandb_plugin, name="wandb")
    yield
    plugins.reset()


def open_tracker(tmp_path, run_id="run-1", resume_step=None, **fields):
    config = validate_section("tracker", {"type": "wandb", "mode": "offline", "save_code": False, **fields})
    run_dir = tmp_path / "logs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    return config.init(RunInfo(run_id=run_id, run_dir=str(run_dir), config={}, resume_step=resume_step))


def only_run(run_dir, run_id):
    files = offline_run_files(str(run_dir), run_id)
    assert len(files) == 1, files
    return read_offline_run(files[0])


def test_offline_run_holds_metrics_histograms_text_config_summary_and_artifacts(tmp_path, wandb_only):
    tracker = open_tracker(tmp_path, project="levanter-test", name="tiny", tags=["gpt2", "test"])
    tracker.log_hyperparameters({"model": {"type": "gpt2", "hidden_dim": 32}, "trainer": {"seed": 0}})
    weights = np.linspace(-1.0, 1.0, 101)
    for step in (1, 2, 3):
        tracker.log({"train/loss": 4.0 / step, "optim/learning_rate": np.float32(0.01)}, step=step)
    tracker.log({"watch/params": Histogram.from_values(weights, bins=4), "sample": "def f(x):"}, step=3)
    tracker.log({"viz/logprobs": "<table><tr><td>tok</td></tr></table>"}, step=3)
    record = tmp_path / "config.yaml"
    record.write_text("trainer: {seed: 0}\n")
    tracker.log_artifact(str(record), name="config.yaml", type="run_record")
    tracker.log_summary({"last_loss": 4.0 / 3, "final_step": 3})
    tracker.finish()

    run = only_run(tmp_path / "logs" / "run-1", "run-1")
    assert (run.run_id, run.project, run.name, run.tags) == ("run-1", "levanter-test", "tiny", ["gpt2", "test"])
    assert run.steps("train/loss") == {1: 4.0, 2: 2.0, 3: pytest.approx(4.0 / 3)}
    assert run.steps("optim/learning_rate")[2] == pytest.approx(0.01)
    histogram = run.steps("watch/params")[3]
    assert histogram["_type"] == "histogram" and histogram["values"] == [25, 25, 25, 26]
    assert histogram["bins"] == pytest.approx([-1.0, -0.5, 0.0, 0.5, 1.0])
    assert run.steps("sample")[3]["_type"] == "table-file"
    assert run.steps("viz/logprobs")[3]["_type"] == "html-file"
    assert run.config == {"model": {"type": "gpt2", "hidden_dim": 32}, "trainer": {"seed": 0}}
    assert run.summary["last_loss"] == pytest.approx(4.0 / 3) and run.summary["final_step"] == 3
    assert {"name": "config.yaml", "type": "run_record", "files": ["config.yaml"]} in run.artifacts


def test_a_resumed_run_continues_the_same_wandb_run_without_logging_steps_twice(tmp_path, wandb_only):
    first = open_tracker(tmp_path, run_id="resumable")
    for step in range(1, 6):  # killed after step 5; its last checkpoint was at step 3
        first.log({"train/loss": 10.0 - step}, step=step)
    first.finish()
    second = open_tracker(tmp_path, run_id="resumable", resume_step=3)
    for step in range(1, 8):
        second.log({"train/loss": 10.0 - step}, step=step)
    second.finish()

    files = offline_run_files(str(tmp_path / "logs" / "resumable"), "resumable")
    assert len(files) == 2  # one per start, both in the run directory, both of run id `resumable`
    before, after = (read_offline_run(f) for f in files)
    assert before.run_id == after.run_id == "resumable"
    assert sorted(before.steps("train/loss")) == [1, 2, 3, 4, 5]
    assert sorted(after.steps("train/loss")) == [4, 5, 6, 7]


def test_an_explicit_id_overrides_the_run_id(tmp_path, wandb_only):
    open_tracker(tmp_path, run_id="levanter-run", id="my-wandb-id").finish()
    assert only_run(tmp_path / "logs" / "levanter-run", "my-wandb-id").run_id == "my-wandb-id"


@pytest.mark.parametrize("status, exit_code", [("success", 0), ("failed", 1), ("interrupted", 130)])
def test_the_wandb_run_ends_with_the_exit_code_of_how_the_training_run_ended(tmp_path, wandb_only, status, exit_code):
    """W&B shows a run finished with a non-zero exit code as failed."""
    tracker = open_tracker(tmp_path, run_id=f"run-{status}")
    tracker.log({"train/loss": 3.0}, step=1)
    tracker.finish(status)
    assert only_run(tmp_path / "logs" / f"run-{status}", f"run-{status}").exit_code == exit_code


def test_an_id_wandb_cannot_take_is_a_config_error_naming_the_field(wandb_only):
    with pytest.raises(ValidationError) as error:
        validate_section("tracker", {"type": "wandb", "id": "team/run:1"})
    assert error.value.errors()[0]["loc"] == ("id",)
    assert "not a W&B run id" in str(error.value)


def git(cwd, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd, check=True, capture_output=True
    )


def test_save_code_saves_the_working_directorys_git_files_commit_and_diff(tmp_path, monkeypatch, wandb_only):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "model.py").write_text("HIDDEN = 32\n")
    (repo / ".gitignore").write_text("data/\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    (repo / "pkg" / "model.py").write_text("HIDDEN = 64\n")  # uncommitted change
    (repo / "notes.py").write_text("# new, untracked\n")
    (repo / "data").mkdir()
    (repo / "data" / "big.bin").write_bytes(b"\0" * 100)  # ignored: not code
    monkeypatch.chdir(repo / "pkg")

    open_tracker(tmp_path, save_code=True).finish()

    run = only_run(tmp_path / "logs" / "run-1", "run-1")
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert run.git_commit == sha
    code = [a for a in run.artifacts if a["type"] == "code"]
    assert len(code) == 1 and sorted(code[0]["files"]) == [".gitignore", "notes.py", "pkg/model.py"]
    assert "diff.patch" in run.files
    patch = os.path.join(os.path.dirname(run.path), "files", "diff.patch")
    with open(patch) as f:
        assert "+HIDDEN = 64" in f.read()


def test_save_xla_dumps_uploads_the_dump_directory_named_in_xla_flags(tmp_path, monkeypatch, wandb_only):
    dumps = tmp_path / "xla dumps"
    dumps.mkdir()
    (dumps / "module_0001.before_optimizations.txt").write_text("HloModule jit_step\n")
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to='{dumps}' --xla_dump_hlo_pass_re=.*")
    open_tracker(tmp_path, save_xla_dumps=True).finish()

    run = only_run(tmp_path / "logs" / "run-1", "run-1")
    assert {"name": "xla_dumps-run-1", "type": "xla_dumps", "files": ["module_0001.before_optimizations.txt"]} in (
        run.artifacts
    )


@pytest.mark.slow
def test_training_with_json_and_wandb_logs_the_same_losses_and_resumes_the_same_run(tmp_path):
    from levanter_core.config.train import load_train_config
    from levanter_core.run import run_training

    plugins.reset()  # entry points: gpt2 and this plugin, as installed
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data = {
        "train_urls": [write_jsonl(data_dir / "train.jsonl", code_docs(200))],
        "validation_urls": [write_jsonl(data_dir / "valid.jsonl", code_docs(20, offset=500))],
        "cache_dir": str(tmp_path / "cache"),
    }

    def train(steps):
        trackers = [{"type": "json"}, {"type": "wandb", "mode": "offline", "project": "e2e"}]
        path = run_config(tmp_path, data, run_id="wb", steps=steps, tracker=trackers)
        loaded, _ = load_train_config(path)
        return run_training(loaded, config_path=path, progress=False)

    train(4)
    train(6)  # resumes from the final checkpoint at step 4
    plugins.reset()

    with open(tmp_path / "logs" / "wb" / "metrics.jsonl") as f:
        logged = {r["step"]: r for r in map(json.loads, f)}
    first, resumed = (read_offline_run(p) for p in offline_run_files(str(tmp_path / "logs" / "wb"), "wb"))
    assert first.run_id == resumed.run_id == "wb" and first.project == "e2e"
    assert first.steps("train/loss") == {s: pytest.approx(logged[s]["train/loss"]) for s in (1, 2, 3, 4)}
    assert resumed.steps("train/loss") == {s: pytest.approx(logged[s]["train/loss"]) for s in (5, 6)}
    assert first.steps("eval/loss")[3] == pytest.approx(logged[3]["eval/loss"])
    assert first.config["model"]["hidden_dim"] == 32 and resumed.config["trainer"]["num_train_steps"] == 6
    assert resumed.summary["final_step"] == 6
    assert resumed.summary["last_loss"] == pytest.approx(logged[6]["train/loss"])
