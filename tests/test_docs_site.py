"""The documentation site builds strictly (`make docs-check`): a broken link or anchor, a page
left out of mkdocs.yml's nav, or an API reference that no longer resolves fails `make test`."""

import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings_handlers.python")
pytest.importorskip("material")


def test_the_site_builds_strictly_with_the_api_reference(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The API reference is generated from the docstrings: the hooks a plugin implements, and
    # the mixin a model family's tests inherit.
    plugins = (site / "api" / "plugins" / "index.html").read_text()
    assert 'id="levanter_core.plugins.hookspecs.register_models"' in plugins
    assert 'id="levanter_core.plugins.Registry"' in plugins
    testing = (site / "api" / "testing" / "index.html").read_text()
    assert 'id="levanter_core.testing.model_family.ModelFamilyTests"' in testing
    # Every guide is a page of the site.
    for page in os.listdir(os.path.join(REPO, "docs")):
        if page.endswith(".md") and page != "index.md":
            assert (site / page.removesuffix(".md") / "index.html").is_file(), page
