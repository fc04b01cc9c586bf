"""Every distribution in the repository (the core, each plugin, each example) declares its
license as an SPDX expression, which setuptools 77+ understands; the ``{ text = ... }`` table
is deprecated. And each still builds: its metadata comes out of setuptools without a
deprecation warning and with ``License-Expression``."""

import glob
import os
import shutil
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO

PROJECTS = sorted(
    os.path.relpath(os.path.dirname(path), REPO) or "."
    for path in [os.path.join(REPO, "pyproject.toml"), *glob.glob(os.path.join(REPO, "*", "*", "pyproject.toml"))]
    if not os.path.relpath(path, REPO).startswith((".venv", "build"))
)


def _pyproject(project: str) -> dict:
    with open(os.path.join(REPO, project, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_every_distribution_is_found():
    assert "." in PROJECTS and "examples/tracker-csv" in PROJECTS
    assert {"plugins/models-gpt2", "plugins/tracker-wandb", "plugins/tracker-tensorboard"} <= set(PROJECTS)


@pytest.mark.parametrize("project", PROJECTS)
def test_license_is_an_spdx_string_and_setuptools_is_new_enough_for_it(project):
    data = _pyproject(project)
    assert data["project"]["license"] == "Apache-2.0", f"{project}/pyproject.toml: license must be an SPDX string"
    # A license expression needs setuptools 77 or later to build.
    setuptools = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools == ["setuptools>=77"], f"{project}/pyproject.toml: build-system requires {setuptools}"
    # An SPDX license and a "License ::" classifier together are refused by setuptools.
    assert not [c for c in data["project"].get("classifiers", []) if c.startswith("License ::")]


# Builds the metadata of the project in the working directory as `pip install -e` does
# first, turning setuptools' deprecation warnings (the `{ text = ... }` license) into errors.
_BUILD_METADATA = """
import sys, warnings
from setuptools import build_meta
from setuptools.warnings import SetuptoolsDeprecationWarning
warnings.simplefilter("error", SetuptoolsDeprecationWarning)
print(build_meta.prepare_metadata_for_build_editable(sys.argv[1]))
"""


# What a build reads: everything but tests, docs, the environment and the other distributions.
_NOT_BUILT = ("*.egg-info", "__pycache__", "build", ".*", "tests", "docs", "plugins", "examples", "bench", "config")


@pytest.mark.parametrize("project", [".", "plugins/models-gpt2", "examples/tracker-csv"])
def test_metadata_builds_with_the_license_expression(project, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(os.path.join(REPO, project), source, ignore=shutil.ignore_patterns(*_NOT_BUILT))
    out = tmp_path / "metadata"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", _BUILD_METADATA, str(out)], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    info = out / result.stdout.strip().splitlines()[-1] / "METADATA"
    assert "License-Expression: Apache-2.0" in info.read_text().splitlines()
