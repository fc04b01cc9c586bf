"""Registries: for each kind of plugin-provided thing, ``type name -> Entry``.

A plugin registers a type with its config class, or with the class's import path as a
string (``"levanter_model_llama.llama:LlamaConfig"``). The string form keeps discovery
cheap: ``levanter plugins`` and ``levanter --help`` list every type without importing any
implementation (nor JAX), and a type's module is imported the first time something needs
its class, usually because a config names it.
"""

from __future__ import annotations

import dataclasses
import functools
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
        Kind("data_format", "register_data_formats", "levanter_core.data.formats:FormatConfig", "data.format.type"),
        Kind("optimizer", "register_optimizers", "levanter_core.optim.config:OptimizerConfig", "optimizer.type"),
        Kind("tracker", "register_trackers", "levanter_core.tracker.base:TrackerConfig", "trainer.tracker.type"),
        Kind(
            "checkpointer",
            "register_checkpointers",
            "levanter_core.checkpoint.config:CheckpointerConfig",
            "trainer.checkpointer.type",
        ),
        Kind("evaluator", "register_evaluators", "levanter_core.trainer.evaluators:EvaluatorConfig", "evaluators[].type"),
        Kind("objective", "register_objectives", "levanter_core.objective:Objective", "the model type's objective"),
    )
}

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered type: its name, its config class (or the class's ``"module:Class"`` path,
    imported on first use), and who provided it."""

    kind: str
    name: str
    target: type | str
    plugin: str
    distribution: str | None
    version: str | None

    @property
    def loaded(self) -> bool:
        """Whether the config class is imported already."""
        return not isinstance(self.target, str) or "config_cls" in self.__dict__

    @functools.cached_property
    def config_cls(self) -> type:
        """The config class; a string target is imported now, and checked against the kind's
        base class (a :class:`PluginError` naming the plugin if it cannot be)."""
        if not isinstance(self.target, str):
            return self.target
        module, _, attr = self.target.partition(":")
        try:
            found = importlib.import_module(module)
            for part in attr.split("."):
                found = getattr(found, part)
        except Exception as e:
            raise PluginError(
                f"{self.kind} type {self.name!r} of plugin {self.plugin!r} ({self.provider}) cannot be loaded: "
                f"importing {self.target!r} failed: {type(e).__name__}: {e}"
            ) from e
        _check_subclass(self, found)
        return found

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
        if isinstance(entry.target, str):
            if not _TARGET_RE.match(entry.target):
                raise PluginError(
                    f"plugin {entry.plugin!r} registered {self.kind.name} type {entry.name!r} with "
                    f"{entry.target!r}; a class or its import path as 'package.module:Class' is expected"
                )
        else:
            _check_subclass(entry, entry.target)
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
        return f"unknown {self.kind.name.replace('_', ' ')} type {name!r}; installed: {self.describe_choices()}"

    def entry_for_class(self, cls: type) -> Entry | None:
        """The entry whose config class is ``cls`` (imports only the entries that could be it)."""
        path = f"{cls.__module__}:{cls.__qualname__}"
        for entry in self._entries.values():
            if entry.target is cls or entry.target == path or (entry.loaded and entry.config_cls is cls):
                return entry
        return None


def _check_subclass(entry: Entry, cls) -> None:
    base = KINDS[entry.kind].base_class()
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PluginError(
            f"plugin {entry.plugin!r} registered {entry.kind} type {entry.name!r} with "
            f"{cls!r}, which is not a subclass of {base.__module__}.{base.__qualname__}"
        )


def _who(entry: Entry) -> str:
    if entry.distribution:
        return f"{entry.provider} (plugin {entry.plugin!r})"
    return entry.provider
