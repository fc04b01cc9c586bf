"""Registries: for each kind of plugin-provided thing, ``type name -> Entry``."""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Iterator

from levanter_core.errors import PluginError


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of registrable thing: its hook and the base class its configs extend."""

    name: str
    hook: str
    base: str  # "module:Class", imported only when the registry is built
    field: str  # the config field that selects it, for messages

    def base_class(self) -> type:
        module, _, attr = self.base.partition(":")
        return getattr(importlib.import_module(module), attr)


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("model", "register_models", "levanter_core.models.lm:LmConfig", "model.type"),
        Kind("data_source", "register_data_sources", "levanter_core.data.source:DataSourceConfig", "data.type"),
        Kind("optimizer", "register_optimizers", "levanter_core.optim.config:OptimizerConfig", "optimizer.type"),
        Kind("tracker", "register_trackers", "levanter_core.tracker.base:TrackerConfig", "trainer.tracker.type"),
        Kind(
            "checkpointer",
            "register_checkpointers",
            "levanter_core.checkpoint.config:CheckpointerConfig",
            "trainer.checkpointer.type",
        ),
    )
}

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered type: its name, config class, and who provided it."""

    kind: str
    name: str
    config_cls: type
    plugin: str
    distribution: str | None
    version: str | None

    @property
    def provider(self) -> str:
        """``distribution version`` (or ``in-process plugin 'name'``)."""
        if self.distribution:
            return f"{self.distribution} {self.version}"
        return f"in-process plugin {self.plugin!r}"


class Registry:
    """The type names of one kind. Built by :func:`levanter_core.plugins.registry_for`."""

    def __init__(self, kind: Kind):
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def add(self, entry: Entry) -> None:
        if not isinstance(entry.name, str) or not _NAME_RE.match(entry.name):
            raise PluginError(
                f"plugin {entry.plugin!r} registered an invalid {self.kind.name} type name {entry.name!r}: "
                "use letters, digits, '_', '-' or '.'"
            )
        base = self.kind.base_class()
        if not (isinstance(entry.config_cls, type) and issubclass(entry.config_cls, base)):
            raise PluginError(
                f"plugin {entry.plugin!r} registered {self.kind.name} type {entry.name!r} with "
                f"{entry.config_cls!r}, which is not a subclass of {base.__module__}.{base.__qualname__}"
            )
        previous = self._entries.get(entry.name)
        if previous is not None:
            raise PluginError(
                f"{self.kind.name} type {entry.name!r} is registered twice: by {_who(previous)} "
                f"and by {_who(entry)}. "
                "Uninstall one of them."
            )
        self._entries[entry.name] = entry

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> Entry:
        """The entry for ``name``; raises ``KeyError`` with the installed choices."""
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(self.describe_unknown(name)) from None

    def describe_choices(self) -> str:
        if not self._entries:
            return f"no {self.kind.name} types are installed"
        return ", ".join(f"{e.name} ({e.provider})" for e in self)

    def describe_unknown(self, name: str) -> str:
        return f"unknown {self.kind.name} type {name!r}; installed: {self.describe_choices()}"

    def entry_for_class(self, cls: type) -> Entry | None:
        for entry in self._entries.values():
            if entry.config_cls is cls:
                return entry
        return None


def _who(entry: Entry) -> str:
    if entry.distribution:
        return f"{entry.provider} (plugin {entry.plugin!r})"
    return entry.provider
