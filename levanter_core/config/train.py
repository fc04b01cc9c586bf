"""The whole configuration of a training run, and loading it from a file."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import Field, ValidationError

from levanter_core.config.base import ConfigModel, Typed, typed_field_kind
from levanter_core.config.loader import Sources, load_config_dict
from levanter_core.data.config import DataSection, data_known_fields
from levanter_core.errors import ConfigError
from levanter_core.trainer.config import TrainerConfig


class TrainConfig(ConfigModel):
    """A training run: ``data``, ``model``, ``trainer`` and ``optimizer`` sections."""

    data: DataSection  # type: ignore[valid-type]
    """The training (and validation) data: one source written inline (``type``, default
    ``url``) or named sources under ``configs`` mixed by ``train_weights``; the tokenizer, the
    cache directory and the shuffling they share."""
    model: Typed("model")  # type: ignore[valid-type]
    """The architecture, chosen by ``type`` among the installed model plugins."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The training loop, parallelism, evaluation, tracking and checkpoints."""
    optimizer: Typed("optimizer", "adam") = Field(default_factory=dict)  # type: ignore[valid-type]
    """The optimizer and learning-rate schedule (``type``, default ``adam``)."""

    initialize_from_hf: str | None = None
    """Start from the weights of a Hugging Face model (a local directory, or a hub name when
    the hub is reachable) for continued pretraining. Its tensors must fit ``model`` exactly,
    unless ``use_hf_model_config`` is set. Ignored when the run resumes from its own checkpoint
    or ``trainer.initialize_from`` is set."""

    use_hf_model_config: bool = False
    """With ``initialize_from_hf``: take the architecture from the Hugging Face
    ``config.json`` instead of the ``model`` section (whose ``seq_len`` is kept)."""


def load_train_config(path: str, overrides: list[str] | None = None) -> tuple[TrainConfig, dict]:
    """Load, include, override and validate. Returns the config and the raw merged dict.

    Raises :class:`ConfigError` with one message for people on any problem.
    """
    raw, sources = load_config_dict(path, overrides)
    return validate_train_config(raw, sources), raw


def validate_train_config(raw: dict, sources: Sources) -> TrainConfig:
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, raw, sources)) from None


# -- messages ------------------------------------------------------------------------------


def format_validation_error(error: ValidationError, raw: dict, sources: Sources) -> str:
    lines = [f"invalid config {sources.main_file}:"]
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        dotted = ".".join(str(p) for p in loc) or "(top level)"
        lines.append(f"  {dotted} ({sources.place_of(loc)}): {_describe(err, raw)}")
    return "\n".join(lines)


def _describe(err: dict, raw: dict) -> str:
    kind, loc = err["type"], tuple(err["loc"])
    if kind == "extra_forbidden":
        known = _known_fields(loc[:-1], raw)
        hint = ""
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        if close:
            hint = f"; did you mean {close[0]!r}?"
        elif known:
            hint = f"; known fields here: {', '.join(known)}"
        return f"unknown field {loc[-1]!r}{hint}"
    if kind == "missing":
        return "this field is required"
    msg = err["msg"].removeprefix("Value error, ")
    if kind in ("unknown_type", "missing_type", "typed_section", "misplaced_field"):
        return msg
    given = err.get("input")
    if isinstance(given, (str, int, float, bool, list)) or given is None:
        return f"{msg} (got {given!r})"
    return msg


def _known_fields(loc: tuple, raw: dict) -> list[str]:
    """The field names allowed at ``loc`` (for did-you-mean hints)."""
    from levanter_core.plugins import registry

    cls: Any = TrainConfig
    node: Any = raw
    if loc[:1] == ("data",):
        return data_known_fields(loc[1:], raw.get("data"))
    for part in loc:
        node = _child(node, part)
        if isinstance(part, int):  # an item of a list of sections: same class
            continue
        if not (isinstance(cls, type) and issubclass(cls, ConfigModel)) or part not in cls.model_fields:
            return []
        field = cls.model_fields[part]
        cls = field.annotation
        typed = typed_field_kind(field)
        if typed is not None:
            kind, default = typed
            name = node.get("type", default) if isinstance(node, dict) else None
            reg = registry(kind)
            if name not in reg:
                return []
            cls = reg.get(name).config_cls
    if isinstance(cls, type) and issubclass(cls, ConfigModel):
        return sorted(cls.model_fields)
    return []


def _child(node: Any, part: Any) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and part < len(node):
        return node[part]
    return None
