"""Base classes for configuration sections, and the polymorphic ``type`` field.

Every section is a frozen pydantic model that rejects unknown keys. A
polymorphic section (``model``, ``optimizer``, ``data``, each tracker, the
checkpointer) is a :class:`TypedConfig`: its ``type`` names an entry in the
matching plugin registry, and the rest of the section is validated by that
entry's config class. Field docstrings are the reference documentation: they
become ``levanter train --help`` and ``docs/configuration.md``.
"""

from __future__ import annotations

from typing import Annotated, Any, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError, core_schema

from levanter_core.config.types import MAX_INT, not_a_bool
from levanter_core.plugins import KINDS, registry

_SCHEMA_KEYS = (
    *("schema", "items_schema", "keys_schema", "values_schema"),
    *("lax_schema", "strict_schema", "json_schema", "python_schema"),
)
"""Keys of a pydantic core schema that hold the schema of a value (serialization is left alone)."""


def _checked_numbers(schema: Any) -> Any:
    """``schema`` (a pydantic core schema) with every ``int`` and ``float`` in it checked as
    :class:`ConfigModel` says. Returns a new schema; schemas already checked are kept."""
    if not isinstance(schema, dict):
        return schema
    kind = schema.get("type")
    if kind == "int":
        return _checked_int(schema)
    if kind == "float":
        checked = {**schema, "allow_inf_nan": schema.get("allow_inf_nan", False)}
        return core_schema.no_info_before_validator_function(not_a_bool, checked)
    if kind in ("function-before", "function-after") and _check_of(schema) is not_a_bool:
        return schema  # checked already (a nested section's schema, seen again)
    if kind == "function-after" and hasattr(_check_of(schema), "__levanter_int_range__"):
        inner = schema["schema"]  # whole_number(): its range replaces the default bound
        return {**schema, "schema": core_schema.no_info_before_validator_function(not_a_bool, inner)}
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_KEYS or (key == "items_schema" and isinstance(value, list)):
            out[key] = [_checked_numbers(v) for v in value] if isinstance(value, list) else _checked_numbers(value)
        elif key == "fields" and isinstance(value, dict):  # a model's or a typed dict's fields
            out[key] = {name: _checked_numbers(field) for name, field in value.items()}
        elif key == "choices" and isinstance(value, dict):  # a tagged union
            out[key] = {tag: _checked_numbers(choice) for tag, choice in value.items()}
        elif key == "choices":  # a union: schemas, or (schema, label) pairs
            out[key] = [(_checked_numbers(c[0]), c[1]) if isinstance(c, tuple) else _labelled(c) for c in value]
        elif key in ("steps", "definitions"):
            out[key] = [_checked_numbers(v) for v in value]
    return out


def _labelled(choice: dict) -> Any:
    """A union's ``choice``, checked, under the label pydantic gives the unchecked one (``int``,
    ``list[int]``), which error messages show, rather than the name of the checks."""
    checked = _checked_numbers(choice)
    return checked if checked == choice else (checked, _label(choice))


def _label(schema: dict) -> str:
    kind = schema.get("type", "")
    if kind in ("list", "set", "frozenset"):
        return f"{kind}[{_label(schema['items_schema'])}]"
    if kind == "dict":
        return f"dict[{_label(schema['keys_schema'])},{_label(schema['values_schema'])}]"
    if kind in ("nullable", "default"):
        return _label(schema["schema"])
    if kind == "model":
        return schema["cls"].__name__
    return kind


def _check_of(schema: dict) -> Any:
    """The function a ``function-*`` core schema calls."""
    return schema.get("function", {}).get("function")


def _checked_int(schema: dict) -> Any:
    """An ``int`` schema that refuses booleans and, without an upper bound of its own, values
    beyond :data:`MAX_INT` (and below ``-MAX_INT`` without a lower one)."""
    checked = core_schema.no_info_before_validator_function(not_a_bool, schema)
    if "le" in schema or "lt" in schema:
        return checked
    low = schema["ge"] if "ge" in schema else schema["gt"] + 1 if "gt" in schema else -MAX_INT

    def fits(value: int) -> int:
        if not -MAX_INT <= value <= MAX_INT:
            raise PydanticCustomError(
                "int_too_large",
                "expected a whole number from {low} to {high}: counts, steps and sizes must fit JAX's 32-bit integers",
                {"low": low, "high": MAX_INT},
            )
        return value

    return core_schema.no_info_after_validator_function(fits, checked)


class ConfigModel(BaseModel):
    """A configuration section: frozen, hashable, unknown keys are errors.

    Numbers are checked for what the run can use, in every field of every section (plugins'
    included), so that a value that loads does not crash later: ``true``/``false`` is not a
    number; a float must be finite (no ``.inf``, ``.nan``); an ``int`` must fit JAX's 32-bit
    integers (:data:`~levanter_core.config.types.MAX_INT`) unless its type gives an upper bound
    of its own (``Field(le=...)``, :func:`~levanter_core.config.types.whole_number`)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        arbitrary_types_allowed=True,
        validate_default=True,
        defer_build=True,
    )

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        return _checked_numbers(handler(source))

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs):
        super().__pydantic_init_subclass__(**kwargs)
        # A field redeclared only to change its default (a model family's own defaults) keeps
        # the docstring its parent gave it, so --help and the reference still explain it.
        for name, field in cls.__pydantic_fields__.items():
            if field.description:
                continue
            for base in cls.__mro__[1:]:
                parent = getattr(base, "__pydantic_fields__", {}).get(name)
                if parent is not None and parent.description:
                    field.description = parent.description
                    break


class TypedConfig(ConfigModel):
    """A section whose ``type`` selects an implementation from a plugin registry."""

    type: str = ""
    """The registered type name (see ``levanter plugins``)."""


def accepted_only_as(allowed: Any, *fields: str, why: str):
    """A validator for Levanter fields that are accepted only as ``allowed`` (``None`` or
    ``False``: compared by identity, so ``0`` is not ``False``); any other value is refused with
    ``why`` (what to do instead). Assign it in the class body:
    ``_no_haps = accepted_only_as(None, "haps", why="...")``."""

    def check(cls, value):
        if value is not allowed:
            raise ValueError(why)
        return value

    return field_validator(*fields)(check)


def _fail(loc: tuple, kind: str, message: str, value: Any) -> ValidationError:
    return ValidationError.from_exception_data(
        "config",
        [{"type": PydanticCustomError(kind, message), "loc": loc, "input": value}],
    )


def _validate_one(kind: str, default_type: str | None, value: Any, loc: tuple = ()) -> TypedConfig:
    base = KINDS[kind].base_class()
    if isinstance(value, base):
        return cast(TypedConfig, value)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise _fail(loc, "typed_section", f"expected a mapping with a `type` field, got {value!r}", value)
    reg = registry(kind)
    name = value.get("type", default_type)
    if name is None:
        raise _fail(
            loc + ("type",), "missing_type", f"a {kind} `type` is required; installed: {reg.describe_choices()}", value
        )
    if not isinstance(name, str) or name not in reg:
        raise _fail(loc + ("type",), "unknown_type", reg.describe_unknown(str(name)), name)
    cls = reg.get(name).config_cls
    try:
        return cls.model_validate({**value, "type": name})
    except ValidationError as e:
        if not loc:
            raise
        errors: list[Any] = [{**err, "loc": loc + tuple(err["loc"])} for err in e.errors()]
        raise ValidationError.from_exception_data("config", errors) from None


def validate_section(kind: str, value: Any) -> TypedConfig:
    """Validate one ``kind`` section (a mapping with ``type``) into its registered config class,
    e.g. the ``model`` section stored in a checkpoint."""
    return _validate_one(kind, None, value)


def _serialize(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_serialize(v) for v in value]
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def _tagged(func, kind: str, default_type: str | None):
    # Lets tools that walk the schema (error hints, --help) find which registry a field uses.
    func.__levanter_kind__ = kind
    func.__levanter_default__ = default_type
    return func


def Typed(kind: str, default_type: str | None = None) -> Any:
    """Annotation for a field holding one ``kind`` section chosen by its ``type``."""

    def validate(value: Any) -> TypedConfig:
        return _validate_one(kind, default_type, value)

    return Annotated[
        Any,
        PlainValidator(_tagged(validate, kind, default_type)),
        PlainSerializer(_serialize),
        WithJsonSchema({"type": "object", "description": f"a {kind} section selected by `type`"}),
    ]


def TypedList(kind: str, default_type: str | None = None) -> Any:
    """Like :func:`Typed`, but the field may also hold a list of sections; it is
    always stored as a tuple."""

    def validate(value: Any) -> tuple:
        if isinstance(value, (list, tuple)):
            return tuple(_validate_one(kind, default_type, v, (i,)) for i, v in enumerate(value))
        return (_validate_one(kind, default_type, value),)

    return Annotated[
        Any,
        PlainValidator(_tagged(validate, kind, default_type)),
        PlainSerializer(_serialize),
        WithJsonSchema({"type": "array", "description": f"one or more {kind} sections selected by `type`"}),
    ]


def fixed_type(field: Any) -> bool:
    """Whether a :func:`typed_field_kind` field takes its default type only (Levanter's
    ``eval_harness``: always the ``eval_harness`` evaluator)."""
    return any(
        getattr(getattr(meta, "func", None), "__levanter_fixed__", False) for meta in getattr(field, "metadata", ())
    )


def typed_field_kind(field: Any) -> tuple[str, str | None] | None:
    """``(kind, default type)`` if the pydantic ``field`` is :func:`Typed`/:func:`TypedList`."""
    for meta in getattr(field, "metadata", ()):
        func = getattr(meta, "func", None)
        if func is not None and hasattr(func, "__levanter_kind__"):
            return func.__levanter_kind__, func.__levanter_default__
    return None
