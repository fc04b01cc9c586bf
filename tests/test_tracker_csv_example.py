"""The third-party story: ``examples/tracker-csv``, written only from
docs/writing-a-tracker-plugin.md, installs with pip and works in a real run.

The example is installed into the running environment for these tests and uninstalled
afterwards, unless it was installed before they started (then it is left as it was).
Uninstalling matters: every installed tracker type appears in the generated field
reference, which ``test_docs`` compares with docs/config-reference.md.
"""

import csv
import fcntl
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from test_cli_train import make_run

from conftest import REPO, run_cli

EXAMPLE = os.path.join(REPO, "examples", "tracker-csv")
DISTRIBUTION = "levanter-tracker-csv"

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("installs-tracker-csv")]


def _installed() -> bool:
    try:
        importlib.metadata.distribution(DISTRIBUTION)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _pip(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"pip {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def csv_plugin_installed():
    """``pip install -e examples/tracker-csv``, as its README says; undone afterwards. The
    environment is shared by every pytest worker: a lock keeps two from installing and
    uninstalling the example at once, whatever the scheduler does."""
    with open(os.path.join(sys.prefix, ".levanter-tracker-csv-test.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        was_installed = _installed()
        _pip("install", "--no-deps", "--quiet", "-e", EXAMPLE)
        yield
        if not was_installed:
            _pip("uninstall", "--yes", "--quiet", DISTRIBUTION)


def with_trackers(config_path: str, trackers: str) -> None:
    """Give the tiny run of test_cli_train the tracker list ``trackers`` (YAML flow style)."""
    with open(config_path) as f:
        text = f.read()
    with open(config_path, "w") as f:
        f.write(text.replace("trainer:\n", f"trainer:\n  tracker: {trackers}\n", 1))


def test_levanter_plugins_lists_the_example(csv_plugin_installed):
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    by_name = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert by_name["csv"]["distribution"] == DISTRIBUTION
    assert by_name["csv"]["types"] == {"tracker": ["csv"]}


def test_a_training_run_writes_the_same_losses_to_csv_as_to_json(csv_plugin_installed, tmp_path):
    config = make_run(tmp_path)
    with_trackers(config, "[{type: json}, {type: csv}]")
    result = run_cli("train", config, "--no-progress")
    assert result.returncode == 0, result.stderr

    run_dir = tmp_path / "logs" / "cli-tiny"
    with open(run_dir / "metrics.jsonl") as f:
        json_losses = {r["step"]: r["train/loss"] for r in map(json.loads, f) if "train/loss" in r}
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    csv_losses = {int(r["step"]): float(r["train/loss"]) for r in rows if r["train/loss"]}
    assert sorted(csv_losses) == list(range(1, 7))
    assert csv_losses == json_losses
    # eval/loss first appears at step 0 (the initial evaluation), then at steps 3 and 6.
    assert [int(r["step"]) for r in rows if r["eval/loss"]] == [0, 3, 6]


def test_a_bad_csv_field_is_a_config_error_naming_it(csv_plugin_installed, tmp_path):
    config = make_run(tmp_path)
    with_trackers(config, "[{type: json}, {type: csv, filename: ''}]")
    result = run_cli("train", config, "--no-progress")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "trainer.tracker.1.filename" in result.stderr
    assert not (tmp_path / "logs").exists()


def test_the_examples_own_tests_pass_once_installed(csv_plugin_installed):
    """The example is its own distribution with its own tests; run them as its author would."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(EXAMPLE, "tests")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=EXAMPLE,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout
