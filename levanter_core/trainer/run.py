"""Moved to :mod:`levanter_core.run`: the path of one training run.

Every name this module had still imports from here, with a ``DeprecationWarning`` naming its
new home (removed in levanter-core 0.3).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from levanter_core._deprecated import moved

_HOMES = {
    "RunResult": "levanter_core.run.result",
    "run_training": "levanter_core.run.train",
    "preflight": "levanter_core.run.setup",
    "configure_jax": "levanter_core.run.setup",
    "levanter_differences": "levanter_core.run.setup",
    "resolved_config": "levanter_core.run.record",
    "derive_run_id": "levanter_core.run.record",
    "config_digest": "levanter_core.run.record",
    "agreed_run_id": "levanter_core.run.record",
    "write_run_record": "levanter_core.run.record",
    "HfExporter": "levanter_core.run.export",
}
_by_name = moved(
    __name__,
    {
        **_HOMES,
        "_TrainLoop": "levanter_core.run.loop:TrainLoop",
        "_check_model_takes_packed_data": "levanter_core.run.initial:check_model_takes_packed_data",
        "RUN_SETTINGS": "levanter_core.models.lm:LmConfig.run_settings",
    },
)


def __getattr__(name: str) -> Any:
    if name == "plugin_versions":  # a method of the process's plugin manager, not a module's name
        warnings.warn(
            f"{__name__}.plugin_versions moved to levanter_core.plugins.get_manager().versions; use that "
            "(the old path is removed in levanter-core 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module("levanter_core.plugins").get_manager().versions
    return _by_name(name)
