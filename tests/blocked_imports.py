"""Run a subprocess as if some packages were not installed: a ``sitecustomize`` module on
``PYTHONPATH`` puts an import hook first on ``sys.meta_path`` that answers "no module named
..." for them, as Python does for a package that is absent. Children of that process
(``ray start``, tokenizer workers) inherit the environment, and so the same absence."""

from __future__ import annotations

import os

_SITECUSTOMIZE = '''
import os
import sys

_ABSENT = set(os.environ["LEVANTER_TEST_ABSENT_PACKAGES"].split(","))


class _Absent:
    """Finds nothing for the absent packages, and stops the search there."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Absent())
'''


def env_without(packages: list[str], directory, base: dict | None = None) -> dict:
    """``base`` (default: this environment) for a Python process in which ``packages``
    cannot be imported; the hook is written into ``directory``."""
    shim = os.path.join(directory, "absent-packages")
    os.makedirs(shim, exist_ok=True)
    with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE)
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [shim, env.get("PYTHONPATH")] if p)
    env["LEVANTER_TEST_ABSENT_PACKAGES"] = ",".join(packages)
    return env
