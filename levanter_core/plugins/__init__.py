"""The plugin system: pluggy hooks, entry-point discovery, and per-kind registries.

Most code needs only :func:`registry` (``registry("model").get("gpt2")``) and,
in plugins, :data:`hookimpl`. The manager is built lazily, once per process;
:func:`reset` throws it away (tests do this after registering plugins in process).
"""

from __future__ import annotations

from typing import Any

from levanter_core.plugins.hookspecs import hookimpl, hookspec
from levanter_core.plugins.manager import AUTOLOAD_ENV, TRACE_ENV, PluginInfo, PluginManager
from levanter_core.plugins.registry import KINDS, PREFER_ENV, Entry, Registry

__all__ = [
    "AUTOLOAD_ENV",
    "KINDS",
    "PREFER_ENV",
    "TRACE_ENV",
    "Entry",
    "PluginInfo",
    "PluginManager",
    "Registry",
    "get_manager",
    "hookimpl",
    "hookspec",
    "register_plugin",
    "registry",
    "reset",
]

_manager: PluginManager | None = None


def get_manager() -> PluginManager:
    """The process-wide plugin manager, created (and plugins loaded) on first use."""
    global _manager
    if _manager is None:
        _manager = PluginManager()
    return _manager


def reset(*, autoload: bool | None = None) -> PluginManager:
    """Start over with a fresh manager (``autoload=None`` follows the environment)."""
    global _manager
    _manager = PluginManager(autoload=autoload)
    return _manager


def register_plugin(plugin: Any, name: str | None = None) -> None:
    """Register an in-process plugin (a module or an object with ``@hookimpl`` methods)."""
    get_manager().register(plugin, name=name or str(getattr(plugin, "__name__", repr(plugin))))


def registry(kind: str) -> Registry:
    """The registry for ``kind`` (one of :data:`KINDS`)."""
    return get_manager().registry(kind)
