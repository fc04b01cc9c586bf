"""Registries: for each kind of plugin-provided thing, ``type name -> Entry``.

A plugin registers a type with its config class, or with the class's import path as a
string (``"levanter_model_llama.llama:LlamaConfig"``). The string form keeps discovery
cheap: ``levanter plugins`` and ``levanter --help`` list every type without importing any
implementation (nor JAX), and a type's module is imported the first time something needs
its class, usually because a config names it.

Two distributions may register the same name (a third-party ``phi3`` beside the one
``levanter-model-llama`` ships). That *clash* touches that name only: every other type
works, ``levanter plugins`` shows it, and a config that names it stops with an error naming
both distributions. A qualified name, ``DISTRIBUTION:NAME`` (``levanter-model-phi3:phi3``),
picks one of them, anywhere a type name is written; so does the setting
:data:`PREFER_ENV` (``LEVANTER_PLUGINS_PREFER=phi3=levanter-model-phi3``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
from collections.abc import Iterator
from typing import Any

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
        base: type = getattr(importlib.import_module(module), attr)
        return base


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
        Kind(
            "evaluator", "register_evaluators", "levanter_core.trainer.evaluators:EvaluatorConfig", "evaluators[].type"
        ),
        Kind("objective", "register_objectives", "levanter_core.objective:Objective", "the model type's objective"),
    )
}

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")

PREFER_ENV = "LEVANTER_PLUGINS_PREFER"
"""Which distribution a clashed name means: comma-separated ``NAME=DISTRIBUTION`` pairs
(``phi3=levanter-model-phi3``). ``NAME`` is a type name (of any kind) or a Hugging Face
``model_type`` that several plugins claim."""


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
    def config_cls(self) -> type[Any]:
        """The config class; a string target is imported now, and checked against the kind's
        base class (a :class:`PluginError` naming the plugin if it cannot be)."""
        if not isinstance(self.target, str):
            return self.target
        module, _, attr = self.target.partition(":")
        try:
            found: object = importlib.import_module(module)
            for part in attr.split("."):
                found = getattr(found, part)
        except Exception as e:
            raise PluginError(
                f"{self.kind} type {self.name!r} of plugin {self.plugin!r} ({self.provider}) cannot be loaded: "
                f"importing {self.target!r} failed: {type(e).__name__}: {e}"
            ) from e
        return _check_subclass(self, found)

    @property
    def provider(self) -> str:
        """``distribution version`` (or ``in-process plugin 'name'``)."""
        if self.distribution:
            return f"{self.distribution} {self.version}"
        return f"in-process plugin {self.plugin!r}"

    @property
    def qualifier(self) -> str:
        """What a qualified name puts before the colon: the distribution (the plugin's name
        for a plugin registered in process)."""
        return self.distribution or self.plugin

    @property
    def qualified_name(self) -> str:
        """``DISTRIBUTION:NAME``: this entry, even when another distribution registers ``name``."""
        return f"{self.qualifier}:{self.name}"


class Registry:
    """The type names of one kind. Built by :func:`levanter_core.plugins.registry_for`.

    A name is looked up bare (``phi3``) or qualified by the distribution that registered it
    (``levanter-model-phi3:phi3``). A bare name that several distributions register is a clash:
    it is "in" the registry, but :meth:`get` refuses it (a :class:`PluginError` naming them
    all) unless :data:`PREFER_ENV` says which one it means."""

    def __init__(self, kind: Kind):
        self.kind = kind
        self._entries: dict[str, list[Entry]] = {}  # name -> every registration of it, in order

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
        # A second registration of a name is a clash of that name alone (see the module's docstring).
        self._entries.setdefault(entry.name, []).append(entry)

    def __contains__(self, name: str) -> bool:
        return isinstance(name, str) and bool(self._candidates(name))

    def __iter__(self) -> Iterator[Entry]:
        """Every registration, clashed ones included, by name then distribution."""
        every = (e for found in self._entries.values() for e in found)
        return iter(sorted(every, key=lambda e: (e.name, e.qualifier)))

    def __len__(self) -> int:
        return sum(len(found) for found in self._entries.values())

    def names(self) -> list[str]:
        """The names that select one type: each name registered once, and the qualified names of
        each clashed one."""
        return sorted(self.name_of(e) for e in self)

    def name_of(self, entry: Entry) -> str:
        """What a config writes to select ``entry``: its name, qualified when the name clashes."""
        return entry.qualified_name if len(self._entries.get(entry.name, ())) > 1 else entry.name

    def clashes(self) -> dict[str, list[Entry]]:
        """The names registered more than once, with their registrations."""
        return {name: list(found) for name, found in sorted(self._entries.items()) if len(found) > 1}

    def get(self, name: str) -> Entry:
        """The entry for ``name`` (bare or ``DISTRIBUTION:NAME``); raises ``KeyError`` with the
        installed choices for an unknown name, and :class:`PluginError` for a clashed name that
        :data:`PREFER_ENV` does not settle (the message says how to choose)."""
        found = self._candidates(name) if isinstance(name, str) else []
        if not found:
            raise KeyError(self.describe_unknown(name))
        if len(found) > 1 and ":" not in name:
            found = [e for e in found if _same_distribution(e.qualifier, preferred_distribution(name))] or found
        if len(found) > 1:
            raise PluginError(self.describe_clash(name))
        return found[0]

    def _candidates(self, name: str) -> list[Entry]:
        qualifier, _, bare = name.rpartition(":")
        found = self._entries.get(bare, [])
        if qualifier:
            found = [e for e in found if _same_distribution(e.qualifier, qualifier)]
        return found

    def describe_clash(self, name: str) -> str:
        """Which distributions register ``name`` and how to choose one of them."""
        qualifier, _, bare = name.rpartition(":")
        found = self._entries.get(bare, [])
        who = " and ".join(_who(e) for e in found)
        if qualifier:  # one distribution registering a name twice: nothing tells them apart
            return (
                f"{self.kind.name.replace('_', ' ')} type {name!r} is registered {len(found)} times by {who}, "
                f"so even the qualified name is ambiguous: fix or uninstall {qualifier}"
            )
        choices = " or ".join(f"`{e.qualified_name}`" for e in found)
        return (
            f"{self.kind.name.replace('_', ' ')} type {bare!r} is registered by {who}. "
            f"Choose one: write {choices} as {self.kind.field} (a qualified name, DISTRIBUTION:NAME), "
            f"or set {PREFER_ENV}={bare}={found[-1].qualifier} in the environment; or uninstall one of them"
        )

    def describe_choices(self) -> str:
        if not self._entries:
            return f"no {self.kind.name} types are installed"
        parts = []
        for name, found in sorted(self._entries.items()):
            if len(found) == 1:
                parts.append(f"{name} ({found[0].provider})")
            else:
                parts.append(f"{name} (a clash: {', '.join(e.qualified_name for e in found)})")
        return ", ".join(parts)

    def describe_unknown(self, name: str) -> str:
        return f"unknown {self.kind.name.replace('_', ' ')} type {name!r}; installed: {self.describe_choices()}"

    def entry_for_class(self, cls: type) -> Entry | None:
        """The entry whose config class is ``cls`` (imports only the entries that could be it)."""
        path = f"{cls.__module__}:{cls.__qualname__}"
        for entry in self:
            if entry.target is cls or entry.target == path or (entry.loaded and entry.config_cls is cls):
                return entry
        return None


def preferred_distribution(name: str) -> str | None:
    """The distribution :data:`PREFER_ENV` names for ``name``, if any."""
    for pair in os.environ.get(PREFER_ENV, "").split(","):
        key, sep, distribution = pair.partition("=")
        if sep and key.strip() == name and distribution.strip():
            return distribution.strip()
    return None


def _same_distribution(a: str | None, b: str | None) -> bool:
    """Whether two distribution names are the same one (``Levanter_Model.phi3`` is
    ``levanter-model-phi3``, as package installers compare them)."""
    if a is None or b is None:
        return False
    return _normalized(a) == _normalized(b)


def _normalized(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _check_subclass(entry: Entry, cls: object) -> type:
    """``cls``, checked to be a subclass of the base class of ``entry``'s kind."""
    base = KINDS[entry.kind].base_class()
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PluginError(
            f"plugin {entry.plugin!r} registered {entry.kind} type {entry.name!r} with "
            f"{cls!r}, which is not a subclass of {base.__module__}.{base.__qualname__}"
        )
    return cls


def _who(entry: Entry) -> str:
    if entry.distribution:
        return f"{entry.provider} (plugin {entry.plugin!r})"
    return entry.provider
