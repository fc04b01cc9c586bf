"""Names that moved: the old import path keeps working for one minor version, with a warning.

A module whose names moved elsewhere sets ``__getattr__ = moved(__name__, {...})``; Python
calls it only for names the module no longer defines, so everything still defined there is
untouched. Each move is listed in ``CHANGELOG.md`` under "Deprecated".
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved(old_module: str, new_homes: dict[str, str], *, until: str = "0.3") -> Callable[[str], Any]:
    """A module ``__getattr__`` that finds each name of ``new_homes`` in its new home, warning
    once per import site with a ``DeprecationWarning`` that names the new path; other names raise
    ``AttributeError`` as usual. A home is the module the name now lives in under the same name
    (``"levanter_core.layers.kv_cache"``), or ``"module:attribute.path"`` for one that was
    renamed or became an attribute (``"levanter_core.models.lm:LmConfig.run_settings"``)."""

    def __getattr__(name: str) -> Any:
        home = new_homes.get(name)
        if home is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        module, _, path = home.partition(":")
        path = path or name
        warnings.warn(
            f"{old_module}.{name} moved to {module}.{path}; import it from there "
            f"(the old path is removed in levanter-core {until})",
            DeprecationWarning,
            stacklevel=2,
        )
        value: Any = importlib.import_module(module)
        for part in path.split("."):
            value = getattr(value, part)
        return value

    return __getattr__
