import os
import subprocess
import sys

import pytest

import levanter_core.plugins as plugins

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh_plugins():
    """A plugin manager without entry-point plugins; restored to the normal one afterwards."""
    manager = plugins.reset(autoload=False)
    yield manager
    plugins.reset()


def run_cli(*args: str, cwd: str | None = None, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``levanter ARGS`` in a subprocess, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", "from levanter_core.cli import main; main()", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
