"""The core's import graph: no circles, and names that moved still import from their old path.

The layers themselves are checked by ``lint-imports`` (``make lint``, part of ``make test``),
from ``[tool.importlinter]`` in ``pyproject.toml``.
"""

from __future__ import annotations

import importlib
import warnings

import grimp
import pytest


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_of_the_core_imports_itself_back():
    graph = grimp.build_graph("levanter_core", include_external_packages=False)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    # A package's __init__ re-exporting its own modules is not a circle a reader follows.
    edges = {m: {i for i in imported if not m.startswith(i + ".")} for m, imported in edges.items()}
    assert _cycles(edges) == []


def test_a_planted_circle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [("levanter_core.inference.cache", "KvCache", "levanter_core.layers.kv_cache")],
)
def test_a_moved_name_imports_from_its_old_path_with_a_warning(old, name, new):
    """The same object from the old path as from the new one, and a warning naming the new."""
    module = importlib.import_module(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = getattr(module, name)
    assert found is getattr(importlib.import_module(new), name)
    assert any(issubclass(w.category, DeprecationWarning) and f"{new}.{name}" in str(w.message) for w in caught)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        module.NoSuchName  # noqa: B018


def test_the_run_settings_and_plugin_versions_still_import_from_trainer_run():
    from levanter_core.models.lm import LmConfig
    from levanter_core.plugins import get_manager

    run = importlib.import_module("levanter_core.trainer.run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert LmConfig.run_settings == run.RUN_SETTINGS
        assert run.plugin_versions() == get_manager().versions()
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any("LmConfig.run_settings" in m for m in messages)
    assert any("get_manager().versions" in m for m in messages)
