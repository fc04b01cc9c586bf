"""Discovering plugins and building the registries from them.

Discovery order: the core's built-in plugin first, then every entry point in
the ``levanter`` group in the order ``importlib.metadata`` lists them, then any
plugin registered in-process with :func:`register_plugin`. A plugin that fails
to import, implements an unknown hook, or raises from a registration hook is
recorded as failed (``levanter plugins`` shows it) and the others still load.

A type name that two distributions register, or a Hugging Face config that two plugins
claim, is a clash of that name alone (see :mod:`levanter_core.plugins.registry`):
:meth:`PluginManager.clashes` lists them, and using one names both and how to choose.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import sys
import traceback
from typing import Any, cast

import pluggy

from levanter_core import __version__
from levanter_core.errors import PluginError
from levanter_core.plugins import hookspecs
from levanter_core.plugins.registry import (
    KINDS,
    PREFER_ENV,
    Entry,
    Registry,
    _same_distribution,
    _who,
    preferred_distribution,
)

ENTRY_POINT_GROUP = "levanter"
AUTOLOAD_ENV = "LEVANTER_PLUGINS_AUTOLOAD"
"""Set to ``0`` to skip entry-point plugins (tests register theirs in process)."""
TRACE_ENV = "LEVANTER_TRACE_PLUGINS"
"""Set to ``1`` to print every hook call, its arguments and results, to stderr."""

BUILTIN_PLUGIN = "levanter_core.plugins.builtins"


@dataclasses.dataclass
class PluginInfo:
    """What ``levanter plugins`` reports about one plugin."""

    name: str
    distribution: str | None
    version: str | None
    module: str | None
    hooks: list[str] = dataclasses.field(default_factory=list)
    types: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _autoload_enabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class PluginManager:
    """pluggy's manager plus the bookkeeping levanter needs (who provides what)."""

    def __init__(self, *, autoload: bool | None = None):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self._registries: dict[str, Registry] | None = None
        if os.environ.get(TRACE_ENV, "") not in ("", "0"):
            self.pm.trace.root.setwriter(lambda msg: sys.stderr.write(f"[levanter plugins] {msg}"))
            self.pm.enable_tracing()

        builtins = importlib.import_module(BUILTIN_PLUGIN)
        self.register(builtins, name="levanter-core", distribution="levanter-core", version=__version__)
        if _autoload_enabled() if autoload is None else autoload:
            self._load_entry_points()

    # -- discovery -----------------------------------------------------------------
    def _load_entry_points(self) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            name = ep.name if ep.name not in self.plugins else f"{dist}:{ep.name}"
            try:
                plugin = ep.load()
            except BaseException as e:  # a broken plugin must not take the others down
                if isinstance(e, KeyboardInterrupt):
                    raise
                self.plugins[name] = PluginInfo(
                    name, dist, version, ep.value, error=f"import of {ep.value!r} failed: {_short_error(e)}"
                )
                continue
            self.register(plugin, name=name, distribution=dist, version=version)

    def register(self, plugin: Any, *, name: str, distribution: str | None = None, version: str | None = None) -> None:
        """Register ``plugin`` (a module or object with hook implementations)."""
        module = getattr(plugin, "__name__", type(plugin).__name__)
        info = PluginInfo(name, distribution, version, module)
        self.plugins[name] = info
        try:
            self.pm.register(plugin, name=name)
        except Exception as e:
            info.error = f"invalid hook implementation: {_short_error(e)}"
            return
        unknown = [hc.name for hc in self.pm.get_hookcallers(plugin) or [] if not hc.has_spec()]
        if unknown:
            self.pm.unregister(plugin)
            info.error = (
                f"implements unknown hook(s) {', '.join(sorted(unknown))}; known hooks are {', '.join(_hook_names())}"
            )
            return
        info.hooks = sorted(hc.name for hc in self.pm.get_hookcallers(plugin) or [])
        self._registries = None  # rebuilt on next use

    # -- registries ----------------------------------------------------------------
    def registries(self) -> dict[str, Registry]:
        if self._registries is None:
            self._registries = self._build_registries()
        return self._registries

    def registry(self, kind: str) -> Registry:
        return self.registries()[kind]

    def _build_registries(self) -> dict[str, Registry]:
        registries = {kind: Registry(spec) for kind, spec in KINDS.items()}
        for info in self.plugins.values():
            info.types = {}
        for kind, spec in KINDS.items():
            hook = getattr(self.pm.hook, spec.hook)
            for impl in hook.get_hookimpls():  # in registration order
                info = self.plugins[impl.plugin_name]

                def register(name: str, config_cls: type | str, *, _info: PluginInfo = info, _kind: str = kind) -> None:
                    registries[_kind].add(Entry(_kind, name, config_cls, _info.name, _info.distribution, _info.version))
                    _info.types.setdefault(_kind, []).append(name)

                try:
                    impl.function(**dict.fromkeys(impl.argnames, register))
                except PluginError:
                    raise
                except Exception as e:
                    problem = f"{spec.hook} failed: {_short_error(e)}"
                    info.error = f"{info.error}; {problem}" if info.error else problem
        return registries

    def hook(self) -> pluggy.HookRelay:
        return self.pm.hook

    def clashes(self) -> list[dict[str, Any]]:
        """Every type name registered by more than one plugin: its kind, the config field that
        selects it, each registration (distribution, version, plugin, qualified name) and how to
        choose one. (Builds the registries.)"""
        found = []
        for kind, reg in self.registries().items():
            for name, entries in reg.clashes().items():
                found.append(
                    {
                        "kind": kind,
                        "name": name,
                        "field": reg.kind.field,
                        "registrations": [
                            {
                                "distribution": e.distribution,
                                "version": e.version,
                                "plugin": e.plugin,
                                "qualified_name": e.qualified_name,
                            }
                            for e in entries
                        ],
                        "message": reg.describe_clash(name),
                    }
                )
        return found

    def model_type_for_hf_config(self, hf_config: dict[str, Any]) -> Entry | None:
        """The model type that reads the Hugging Face config ``hf_config``: the entry every plugin
        that claims it (``model_type_for_hf_config``) agrees on, or None when no plugin does.

        Each plugin's answer is its own type when it names one it registered (a plugin claiming
        ``phi3`` means its ``phi3``, whoever else registers the name). Plugins that answer with
        different types are a clash: :data:`PREFER_ENV`, keyed by the Hugging Face
        ``model_type`` or by our type name, settles it; otherwise a :class:`PluginError` names
        them all and how to choose."""
        models = self.registry("model")
        answers: list[tuple[PluginInfo, Entry]] = []
        for impl in reversed(self.pm.hook.model_type_for_hf_config.get_hookimpls()):  # pluggy's call order
            info = self.plugins[impl.plugin_name]
            # The hook's contract: a type name or None (Registry.get refuses anything else).
            name = cast("str | None", impl.function(**dict.fromkeys(impl.argnames, hf_config)))
            if name is None:
                continue
            own = [e for e in models if e.name == name and e.plugin == info.name] if ":" not in str(name) else []
            try:
                entry = own[0] if len(own) == 1 else models.get(name)
            except KeyError:
                raise PluginError(
                    f"plugin {info.name!r} ({info.distribution or 'in process'}) maps Hugging Face model_type "
                    f"{hf_config.get('model_type')!r} to {name!r}, which is not a model type: "
                    f"{models.describe_unknown(name)}"
                ) from None
            answers.append((info, entry))
        chosen = list({e.qualified_name: e for _, e in answers}.values())
        if len(chosen) > 1:
            hf_type = hf_config.get("model_type")
            for key in (hf_type, *(e.name for e in chosen)):
                preferred = preferred_distribution(str(key))
                picked = [e for e in chosen if _same_distribution(e.qualifier, preferred)]
                if len(picked) == 1:
                    return picked[0]
            claims = " and ".join(f"{_who(e)} as model type {e.name!r}" for e in chosen)
            raise PluginError(
                f"a Hugging Face config of model_type {hf_type!r} is claimed by {claims}. Choose one by setting "
                f"{PREFER_ENV}={hf_type}={chosen[-1].qualifier} in the environment (or "
                f"{' or '.join(e.qualifier for e in chosen[:-1])}); or uninstall one of them"
            )
        return chosen[0] if chosen else None

    def versions(self) -> dict[str, str | None]:
        """The version of each loaded plugin's distribution (by distribution name; a plugin
        registered without one by its own name): what a run or an export records."""
        return {info.distribution or info.name: info.version for info in self.plugins.values() if not info.error}

    def failures(self) -> list[PluginInfo]:
        return [info for info in self.plugins.values() if info.error]


def _hook_names() -> list[str]:
    return sorted(n for n in dir(hookspecs) if n.startswith(("register_", "model_type_for_")))


def _short_error(e: BaseException) -> str:
    last = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    where = f" ({last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(e).__name__}: {e}{where}"
