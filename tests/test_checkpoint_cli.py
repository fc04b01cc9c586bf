"""Checkpoints as a user meets them through `levanter train`: damaged checkpoints, a
read-only or failing checkpoint directory, and the run record."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_train import make_run, metrics

from conftest import REPO, run_cli

pytestmark = pytest.mark.slow

CKPT = "ckpt/cli-tiny"


def losses(tmp_path) -> dict[int, float]:
    return {m["step"]: m["train/loss"] for m in metrics(tmp_path) if "train/loss" in m}


def remove_a_chunk(checkpoint) -> str:
    """Delete one data chunk of the checkpoint's largest array; return the array's name."""
    arrays = [root for root, _, files in os.walk(checkpoint) if ".zarray" in files]
    largest = max(arrays, key=lambda a: sum(os.path.getsize(os.path.join(a, f)) for f in os.listdir(a)))
    os.remove(os.path.join(largest, next(f for f in sorted(os.listdir(largest)) if not f.startswith("."))))
    return os.path.relpath(largest, checkpoint)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> str:
    """A finished 6-step run with checkpoints at steps 3 and 6, trained once for this module
    (each test damages or extends a copy of it: :func:`trained`); returns its directory."""
    directory = tmp_path_factory.mktemp("finished-run")
    first = run_cli("train", make_run(directory), "--no-progress")
    assert first.returncode == 0, first.stderr
    assert sorted(os.listdir(directory / CKPT)) == ["step-3", "step-6"]
    return str(directory)


def trained(tmp_path, finished_run) -> str:
    """:func:`finished_run` with its logs and checkpoints copied into ``tmp_path`` (its data and
    complete cache, only read, stay shared); returns the path of a config naming the copies."""
    config = (Path(finished_run) / "run.yaml").read_text()
    for kept in ("logs", "ckpt"):
        shutil.copytree(os.path.join(finished_run, kept), tmp_path / kept)
        config = config.replace(os.path.join(finished_run, kept), str(tmp_path / kept))
    (tmp_path / "run.yaml").write_text(config)
    return str(tmp_path / "run.yaml")


def test_a_damaged_final_checkpoint_is_skipped_and_its_steps_retrained_identically(tmp_path, finished_run):
    config = trained(tmp_path, finished_run)
    before = losses(tmp_path)
    damaged = remove_a_chunk(tmp_path / CKPT / "step-6")

    again = run_cli("train", config, "--no-progress")
    assert again.returncode == 0, again.stderr
    assert (
        f"skipped damaged checkpoint {tmp_path / CKPT}/step-6; moved to {tmp_path / CKPT}/step-6.damaged-"
        in again.stdout
    )
    assert damaged in again.stdout  # names the array that cannot be read
    assert f"resumed from {tmp_path / CKPT}/step-3 at step 3" in again.stdout
    assert losses(tmp_path) == before  # steps 4-6 trained again, to the same bits
    entries = sorted(os.listdir(tmp_path / CKPT))
    assert entries[:2] == ["step-3", "step-6"] and entries[2].startswith("step-6.damaged-")


def test_when_every_checkpoint_is_damaged_the_run_stops_instead_of_starting_over(tmp_path, finished_run):
    config = trained(tmp_path, finished_run)
    remove_a_chunk(tmp_path / CKPT / "step-6")
    with open(tmp_path / CKPT / "step-3" / "COMMITTED", "w") as f:
        f.write('{"step": 3, "lea')  # truncated
    before = losses(tmp_path)

    again = run_cli("train", config, "--no-progress")
    assert again.returncode == 2
    assert "Traceback" not in again.stderr
    assert "every checkpoint under" in again.stderr and "Refusing to start again from step 0" in again.stderr
    assert "step-3: its COMMITTED marker is corrupt or truncated" in again.stderr
    assert sorted(os.listdir(tmp_path / CKPT)) == ["step-3", "step-6"]  # nothing moved, nothing new
    assert losses(tmp_path) == before


def train_more(config: str, steps: int, *, prefix: list[str] = (), setup: str = "") -> subprocess.CompletedProcess:
    """``levanter train CONFIG`` to ``steps`` steps, run under the command ``prefix`` and after
    the Python statements ``setup``."""
    main = setup + "from levanter_core.cli import main; main()"
    return subprocess.run(
        [
            *prefix,
            sys.executable,
            "-c",
            main,
            "train",
            config,
            "--no-progress",
            "--trainer.num_train_steps",
            str(steps),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def read_only(directory) -> list[str] | None:
    """A command prefix under which ``directory`` is read-only for the command it runs (for
    root, a read-only bind mount in a private mount namespace); None when this machine
    allows neither that nor a plain permission change."""
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        return []
    if shutil.which("unshare") is None:
        return None
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(directory)]
    probe = subprocess.run([*prefix, "sh", "-c", f'! touch "{directory}/probe" 2>/dev/null'], capture_output=True)
    return prefix if probe.returncode == 0 else None


def test_a_read_only_checkpoint_directory_stops_the_run_with_a_clear_message(tmp_path, finished_run):
    config = trained(tmp_path, finished_run)
    prefix = read_only(tmp_path / "ckpt")
    if prefix is None:
        pytest.skip("this machine can make no directory read-only for this user")
    result = train_more(config, 9, prefix=prefix)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"cannot write checkpoints to {tmp_path / CKPT}: Read-only file system" in result.stderr
    assert "trainer.checkpointer.base_path" in result.stderr
    assert max(losses(tmp_path)) == 6  # stopped before training
    os.chmod(tmp_path / "ckpt", 0o755)


def test_a_save_that_fails_in_the_background_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, finished_run):
    config = trained(tmp_path, finished_run)
    # Writes past 12 KiB fail, as on a full disk: the run's small files fit, the model's arrays do not.
    limit = 12 * 1024
    setup = (
        "import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
    )
    result = train_more(config, 12, setup=setup)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"saving a checkpoint under {tmp_path / CKPT} failed" in result.stderr
    assert "File too large" in result.stderr
    assert f"it resumes from {tmp_path / CKPT}/step-6" in result.stderr
    assert sorted(os.listdir(tmp_path / CKPT)) == ["step-3", "step-6"]  # no debris, nothing lost
    # training went on while the step-9 save was written, until its failure surfaced
    assert max(losses(tmp_path)) >= 9

    resumed = train_more(config, 12)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {tmp_path / CKPT}/step-6 at step 6" in resumed.stdout


def test_the_run_record_is_saved_and_sent_to_the_trackers(tmp_path, recorded_calls, monkeypatch):
    from levanter_core.config.train import load_train_config
    from levanter_core.run import run_training

    monkeypatch.chdir(REPO)
    config_path = make_run(tmp_path)
    config, _ = load_train_config(config_path, ["--trainer.tracker", '[{"type": "json"}, {"type": "recording"}]'])
    run_training(config, config_path=config_path, progress=False)
    recording_tracker = recorded_calls["recording"]

    run_dir = tmp_path / "logs" / "cli-tiny"
    record = json.loads((run_dir / "run.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert record["git"]["sha"] == head and record["git"]["root"] == REPO
    assert record["levanter_core_git"]["sha"] == head  # levanter itself, installed from this checkout
    assert record["plugins"]["levanter-model-gpt2"]
    requirements = (run_dir / "requirements.txt").read_text().splitlines()
    assert "levanter-core==0.1.0" in requirements and any(r.startswith("jax==") for r in requirements)
    assert "model:\n  type: gpt2" in (run_dir / "config.yaml").read_text()

    artifacts = {call[1]: call for call in recording_tracker if call[0] == "artifact"}
    assert set(artifacts) == {"config.yaml", "run.json", "requirements.txt"}
    assert all(call[2] == "run_record" for call in artifacts.values())
    assert json.loads(artifacts["run.json"][3])["git"]["sha"] == head
    hparams = next(call[1] for call in recording_tracker if call[0] == "hparams")
    assert hparams["model"]["hidden_dim"] == 32 and hparams["trainer"]["id"] == "cli-tiny"
    saves = [call[2] for call in recording_tracker if call[0] == "log" and "checkpoint/save_blocked_seconds" in call[2]]
    assert [s["checkpoint/save_blocked_seconds"] >= 0 for s in saves] == [True]  # the step-3 save; step 6 is final
