"""The field reference: every config field with its type, default and docstring.

It is generated from the pydantic models (core sections and every installed
plugin type), so ``levanter train --help`` and ``docs/configuration.md`` always
match the code.
"""

from __future__ import annotations

import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from levanter_core.config.base import ConfigModel, fixed_type, typed_field_kind
from levanter_core.config.train import TrainConfig
from levanter_core.config.types import MAX_INT, format_duration
from levanter_core.data.config import DataConfig
from levanter_core.plugins import registry


def _type_name(annotation: Any) -> str:
    """A short readable name: ``int | None``, ``list of str``, ``one of 'a', 'b'``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is None or annotation is type(None):
        return "null"
    if origin is typing.Annotated:
        for meta in typing.get_args(annotation)[1:]:
            kind = getattr(getattr(meta, "func", None), "__levanter_kind__", None)
            if kind is not None:
                return f"{kind} section"
        return _type_name(args[0])
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin in (list, tuple, set, frozenset):
        inner = [a for a in args if a is not Ellipsis]
        return f"list of {_type_name(inner[0])}" if inner else "list"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}" if args else "mapping"
    if isinstance(annotation, type):
        return {"timedelta": "duration"}.get(annotation.__name__, annotation.__name__)
    return repr(annotation).replace("typing.", "")


def _default(field) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
        if isinstance(value, BaseModel):
            return "(section)"
        if hasattr(value, "total_seconds"):
            return format_duration(value)
        return repr(value)
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
        if isinstance(value, BaseModel):
            return "(section)"
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, BaseModel) for v in value):
            return repr([v.model_dump(exclude_none=True) for v in value])
        return "" if value == {} and typed_field_kind(field) else repr(value)
    return "required"


def iter_fields(cls: type[ConfigModel], prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """Yield ``(dotted name, type, default, description)`` for ``cls`` and its nested sections."""
    for name, field in cls.model_fields.items():
        dotted = f"{prefix}{name}"
        doc = " ".join((field.description or "").split())
        typed = typed_field_kind(field)
        annotation = field.annotation
        if typed is not None:
            kind, default = typed
            reg = registry(kind)
            choices = ", ".join(reg.names()) or "none installed"
            if default:
                default_text = f"type {default}"
            elif not field.is_required() and field.default_factory is None:
                default_text = "none" if field.default in ((), [], None) else repr(field.default)
            else:
                default_text = "required"
            if fixed_type(field):  # one type only: its fields, without [type=...]
                yield dotted, f"{default} section", "null", doc
                if isinstance(default, str) and default in reg:
                    for row in iter_fields(reg.get(default).config_cls, f"{dotted}."):
                        if row[0] != f"{dotted}.type":
                            yield row
                continue
            yield dotted, f"{kind} section", default_text, f"{doc} Types: {choices}."
            for entry in reg:
                yield from iter_fields(entry.config_cls, f"{dotted}[type={entry.name}].")
            continue
        if _is_data_section(field):
            yield dotted, "section", "required", doc
            yield from iter_fields(DataConfig, dotted + ".")
            reg = registry("data_source")
            for entry in reg:
                yield from iter_fields(entry.config_cls, f"{dotted}[type={entry.name}].")
            continue
        variants = _tagged_variants(annotation)
        if variants:
            yield dotted, "section", _default(field), f"{doc} Types: {', '.join(variants)}."
            for type_name, variant in variants.items():
                yield from iter_fields(variant, f"{dotted}[type={type_name}].")
            continue
        nested = _nested_model(annotation)
        if nested is not None:
            is_list = typing.get_origin(annotation) in (list, tuple)
            yield dotted, "list of sections" if is_list else "section", _default(field) if is_list else "", doc
            yield from iter_fields(nested, dotted + ".")
            continue
        if name == "type" and prefix.endswith("]."):
            continue
        yield dotted, _type_name(annotation), _default(field), doc


def _is_data_section(field) -> bool:
    return any(hasattr(getattr(meta, "func", None), "__levanter_data_section__") for meta in field.metadata)


def _tagged_variants(annotation: Any) -> dict[str, type[ConfigModel]]:
    """``type`` name -> section class, when ``annotation`` is a pydantic discriminated union of
    sections (possibly ``| None``), each with a ``Literal`` ``type``; else empty."""
    members, pending = [], [annotation]
    while pending:
        current = pending.pop()
        origin = typing.get_origin(current)
        if origin is typing.Annotated:
            pending.append(typing.get_args(current)[0])
        elif origin in (typing.Union, types.UnionType):
            pending.extend(typing.get_args(current))
        elif current is not type(None):
            members.append(current)
    variants = {}
    for member in members:
        if not (isinstance(member, type) and issubclass(member, ConfigModel) and "type" in member.model_fields):
            return {}
        tags = typing.get_args(member.model_fields["type"].annotation)
        if len(tags) != 1:
            return {}
        variants[tags[0]] = member
    return dict(sorted(variants.items())) if len(variants) > 1 else {}


def _nested_model(annotation: Any) -> type[ConfigModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, ConfigModel):
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], ConfigModel):
        return args[0]
    return None


def field_reference(cls: type[ConfigModel]) -> str:
    """Plain-text reference, one field per entry."""
    lines = []
    for dotted, type_name, default, doc in iter_fields(cls):
        head = f"  {dotted}"
        meta = ", ".join(p for p in (type_name, f"default {default}" if default else "") if p)
        lines.append(f"{head}  ({meta})")
        if doc:
            lines.append(textwrap.fill(doc, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def markdown_reference(cls: type[ConfigModel]) -> str:
    """The same reference as a Markdown table (for docs/)."""
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for dotted, type_name, default, doc in iter_fields(cls):
        cells = [f"`{dotted}`", type_name, f"`{default}`" if default else "", doc]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def main() -> None:
    """Print the Markdown reference (``python -m levanter_core.config.reference > docs/config-reference.md``)."""
    print("# Configuration reference\n")
    print("Generated from the code by `python -m levanter_core.config.reference` with the plugins of this")
    print("repository installed; `levanter train --help` prints the same for whatever is installed.")
    print("A field written `section[type=NAME].field` exists when the section's `type` is `NAME`.")
    print("Numbers: `true`/`false` is not a number; floats must be finite (no `.inf`, `.nan`); a whole")
    print(f"number (int) is at most {MAX_INT} (2^31 - 1, what JAX's 32-bit integers hold) unless its field")
    print("says otherwise (seeds: 0 to 2^32 - 1).\n")
    print(markdown_reference(TrainConfig))


if __name__ == "__main__":
    main()
