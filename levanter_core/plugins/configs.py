"""Configs that plugins ship: a plugin's top-level package may hold YAML files in a
``configs/`` directory (package data in its wheel), and every command that takes a config
accepts one by name when no file of that name exists:

    levanter train llama_nano                        # or llama_nano.yaml
    levanter train levanter-model-llama:llama_nano   # the distribution's, when two ship one

``levanter configs`` lists them. They are found through the ``levanter`` entry points'
packages without importing them (nor JAX): ``importlib.util.find_spec`` locates a package.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os

from levanter_core.errors import ConfigError
from levanter_core.plugins.manager import ENTRY_POINT_GROUP

CONFIGS_DIRECTORY = "configs"


@dataclasses.dataclass(frozen=True)
class PackagedConfig:
    """One YAML file a plugin ships."""

    name: str
    """The file's name without ``.yaml``."""
    path: str
    distribution: str
    package: str

    @property
    def qualified(self) -> str:
        return f"{self.distribution}:{self.name}"


def packaged_configs() -> list[PackagedConfig]:
    """Every config shipped by an installed plugin, sorted by name then distribution."""
    found: dict[tuple[str, str], PackagedConfig] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        package = ep.value.split(":")[0].split(".")[0]
        distribution = ep.dist.name if ep.dist is not None else package
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            directory = os.path.join(location, CONFIGS_DIRECTORY)
            if not os.path.isdir(directory):
                continue
            for file in sorted(os.listdir(directory)):
                if file.endswith((".yaml", ".yml")):
                    name = os.path.splitext(file)[0]
                    path = os.path.join(directory, file)
                    found[(name, distribution)] = PackagedConfig(name, path, distribution, package)
    return sorted(found.values(), key=lambda c: (c.name, c.distribution))


def resolve_config_path(reference: str) -> str:
    """``reference`` itself if it names a file (or looks like a path); else the packaged config it
    names (``name``, ``name.yaml`` or ``distribution:name``). A :class:`ConfigError` lists the
    choices when there is none, or several."""
    if os.path.exists(reference) or os.sep in reference or reference.startswith("."):
        return reference
    distribution, _, name = reference.rpartition(":")
    name = name[:-5] if name.endswith(".yaml") else name[:-4] if name.endswith(".yml") else name
    available = packaged_configs()
    matches = [c for c in available if c.name == name and (not distribution or c.distribution == distribution)]
    if len(matches) == 1:
        return matches[0].path
    if matches:
        choices = ", ".join(c.qualified for c in matches)
        raise ConfigError(f"{reference!r} is shipped by several plugins: {choices}; name one as DISTRIBUTION:NAME")
    shipped = ", ".join(c.name for c in available) or "none (no installed plugin ships configs)"
    raise ConfigError(
        f"config file {reference} does not exist, and no installed plugin ships a config named {name!r}; "
        f"packaged configs: {shipped} (see `levanter configs`)"
    )
