"""Reading a run's configuration: YAML with ``!include``, then command-line overrides.

The result is a plain dict plus a :class:`Sources` table that remembers where
every key came from (file and line, or the command-line flag), so that a
validation error can point at the exact place to fix.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from levanter_core.errors import ConfigError
from levanter_core.plugins.configs import resolve_config_path


@dataclasses.dataclass
class Sources:
    """``dotted path -> "file:line"`` (or ``"command line --x.y"``) for every key seen."""

    main_file: str
    places: dict[tuple, str] = dataclasses.field(default_factory=dict)

    def place_of(self, path: tuple) -> str:
        """Where ``path`` (or its nearest written ancestor) was written."""
        for end in range(len(path), 0, -1):
            place = self.places.get(tuple(path[:end]))
            if place:
                return place
        return self.main_file


MAX_DEPTH = 100
"""How deeply sections and lists may nest in a config, counting through aliases and
``!include``: a config needs a handful of levels, and Python's recursion (in YAML, the
validation and the run record) needs a bound well below its own."""

MAX_VALUES = 100_000
"""How many values (scalars, lists, mappings) a config may hold once its aliases and
includes are expanded, an alias counting wherever it is used: a config holds hundreds, while
a "billion laughs" document holds billions in a few lines."""


class _BoundedLoader(yaml.SafeLoader):
    """A SafeLoader that refuses YAML bombs before building anything: nesting deeper than
    :data:`MAX_DEPTH` and aliases that expand to more than :data:`MAX_VALUES` values, or that
    refer to themselves. ``filename`` names the text in messages; ``depth`` is how deep the
    text sits (an included file's, at its ``!include``); ``budget`` is a one-item list of how
    many values are left to the whole config, shared by its included files."""

    def __init__(self, stream, filename: str, *, depth: int = 0, budget: list[int] | None = None):
        super().__init__(stream)
        self.filename = filename
        self.depth = depth
        self.budget = [MAX_VALUES] if budget is None else budget
        self.node_depths: dict[yaml.Node, int] = {}

    def fetch_flow_collection_start(self, TokenClass):
        # The scanner reads a flow collection (``[[[...``) ahead of the composer, in time that grows
        # with the square of its depth: stop it at the bound.
        if self.flow_level >= MAX_DEPTH:
            raise ConfigError(
                f"{self.filename}:{self.get_mark().line + 1}: sections and lists nested more than {MAX_DEPTH} levels "
                "deep; a config needs only a few levels"
            )
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):  # the aliased node is measured in construct_document
            return super().compose_node(parent, index)
        if self.depth >= MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise ConfigError(
                f"{self.filename}:{mark.line + 1}: sections and lists nested more than {MAX_DEPTH} levels deep; "
                "a config needs only a few levels"
            )
        self.depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if node.tag == "!include":
            self.node_depths[node] = self.depth
        return node

    def construct_document(self, node):
        self.budget[0] -= _expanded_size(node, self.filename, self.depth, self.budget[0])
        return super().construct_document(node)


def _expanded_size(root: yaml.Node, filename: str, depth: int, budget: int) -> int:
    """How many values the document ``root`` builds, each alias counted wherever it is used.
    Raises :class:`ConfigError` naming the line when that is more than ``budget``, when
    aliases nest lists deeper than :data:`MAX_DEPTH` (``depth``: where the document sits), or when
    an alias is used inside the node it names (an endless value). Each node is measured once,
    so this takes time in proportion to the text, however far the aliases would expand."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node, level: int) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        line = f"{filename}:{node.start_mark.line + 1}"
        if key in open_nodes:
            raise ConfigError(
                f"{line}: an alias here refers to itself (the list or mapping holding it): an endless value"
            )
        if level > MAX_DEPTH:
            raise ConfigError(
                f"{line}: aliases nest sections and lists more than {MAX_DEPTH} levels deep; a config needs only a few"
            )
        open_nodes.add(key)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        total = 1 + sum(size(child, level + 1) for child in children)
        open_nodes.discard(key)
        if total > budget:
            raise ConfigError(
                f"{line}: YAML aliases expand the config to more than {MAX_VALUES:,} values (a config holds a few "
                "hundred); repeat fewer aliases, or write the values out"
            )
        sizes[key] = total
        return total

    return size(root, depth + 1)


class _Loader(_BoundedLoader):
    """A bounded loader that records key positions, rejects duplicate keys and knows ``!include``."""

    def __init__(self, stream, filename: str, marks: dict, stack: tuple, *, depth: int = 0, budget=None):
        super().__init__(stream, filename, depth=depth, budget=budget)
        self.key_places = marks
        self.stack = stack


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    mapping: dict = {}
    places: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, (str, int, float, bool)):
            raise ConfigError(
                f"{loader.filename}:{key_node.start_mark.line + 1}: mapping keys must be plain names, got {key!r}"
            )
        if key in mapping:
            raise ConfigError(
                f"{loader.filename}:{key_node.start_mark.line + 1}: key {key!r} appears twice in the same mapping "
                f"(first on line {places[key]})"
            )
        mapping[key] = loader.construct_object(value_node, deep=True)
        places[key] = key_node.start_mark.line + 1
    loader.key_places[id(mapping)] = (loader.filename, places)
    return mapping


def _construct_include(loader: _Loader, node: yaml.ScalarNode) -> Any:
    target = loader.construct_scalar(node)
    path = os.path.normpath(os.path.join(os.path.dirname(loader.filename), target))
    if path in loader.stack:
        chain = " -> ".join(loader.stack + (path,))
        raise ConfigError(f"{loader.filename}:{node.start_mark.line + 1}: !include cycle: {chain}")
    if not os.path.exists(path):
        raise ConfigError(
            f"{loader.filename}:{node.start_mark.line + 1}: !include {target!r}: file {path} does not exist "
            "(include paths are relative to the including file)"
        )
    depth = loader.node_depths.get(node, loader.depth)
    return _load_file(path, loader.key_places, loader.stack + (path,), depth=depth, budget=loader.budget)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor("!include", _construct_include)


def _load_file(path: str, marks: dict, stack: tuple, *, depth: int = 0, budget: list[int] | None = None) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    loader = _Loader(text, path, marks, stack, depth=depth, budget=budget)
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        what = " ".join(p for p in (e.context, e.problem) if p)
        raise ConfigError(f"{where}: invalid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    finally:
        loader.dispose()


def _record_places(obj: Any, path: tuple, marks: dict, sources: Sources) -> None:
    if isinstance(obj, dict):
        filename, places = marks.get(id(obj), (None, {}))
        for key, value in obj.items():
            if key in places:
                sources.places[path + (key,)] = f"{filename}:{places[key]}"
            _record_places(value, path + (key,), marks, sources)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            _record_places(value, path + (i,), marks, sources)


def load_yaml(path: str) -> tuple[dict, Sources]:
    """Load ``path`` with its includes. The top level must be a mapping."""
    path = os.path.normpath(path)
    marks: dict = {}
    data = _load_file(path, marks, (path,))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level of a config must be a mapping of sections, got {type(data).__name__}")
    sources = Sources(path)
    _record_places(data, (), marks, sources)
    return data, sources


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """``["--trainer.num_train_steps", "100", "--data.cache_dir=x"]`` -> ``[(dotted, value), ...]``.

    Values are read as YAML, so ``100`` is an int, ``true`` a bool and
    ``'["a","b"]'`` a list; anything else stays a string.
    """
    overrides = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides are written --section.field VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} needs a value: --{key} VALUE")
            value = args[i + 1]
            i += 1
        i += 1
        overrides.append((key, _override_value(value, f"override --{key}") if value.strip() else value))
    return overrides


def _override_value(text: str, where: str) -> Any:
    """An override's value read as YAML (bounded like a config file); text that is not YAML
    stays a string."""
    loader = _BoundedLoader(text, where)
    try:
        return loader.get_single_data()
    except yaml.YAMLError:
        return text
    finally:
        loader.dispose()


def apply_overrides(data: dict, overrides: list[tuple[str, Any]], sources: Sources) -> dict:
    """Set each dotted key in ``data`` (creating sections as needed). List items are
    addressed by index: ``--trainer.tracker.0.project x``."""
    for dotted, value in overrides:
        parts = list(dotted.split("."))
        if not all(parts):
            raise ConfigError(f"override --{dotted}: empty name in dotted path")
        node: Any = data
        path: tuple = ()
        for part in parts[:-1]:
            node, path = _child(node, part, path, dotted, create=True)
        last = parts[-1]
        if isinstance(node, list):
            index = _index(node, last, dotted)
            node[index] = value
            path = path + (index,)
        else:
            node[last] = value
            path = path + (last,)
        sources.places[path] = f"command line --{dotted}"
    return data


def _index(node: list, part: str, dotted: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override --{dotted}: {part!r} is not an index of a list of {len(node)} items")
    return int(part)


def _child(node: Any, part: str, path: tuple, dotted: str, create: bool) -> tuple[Any, tuple]:
    if isinstance(node, list):
        index = _index(node, part, dotted)
        return node[index], path + (index,)
    if not isinstance(node, dict):
        where = ".".join(map(str, path))
        raise ConfigError(f"override --{dotted}: {where} is a value ({node!r}), not a section")
    if part not in node or node[part] is None:
        node[part] = {}
    return node[part], path + (part,)


def load_config_dict(path: str, override_args: list[str] | None = None) -> tuple[dict, Sources]:
    """The merged config dict (YAML + includes + overrides) and where each key came from.
    ``path`` may also name a config a plugin ships (see :mod:`levanter_core.plugins.configs`)."""
    data, sources = load_yaml(resolve_config_path(path))
    if override_args:
        apply_overrides(data, parse_overrides(override_args), sources)
    return data, sources
