"""Value types written the way the configuration guide writes them."""

from __future__ import annotations

import datetime
import re
from typing import Annotated, Any, Literal

import jmp
from pydantic import AfterValidator, BeforeValidator, PlainSerializer
from pydantic_core import PydanticCustomError

MAX_INT = 2**31 - 1
"""The largest whole number a config field takes unless it says otherwise: counts, steps and
sizes end up in JAX's 32-bit integers (step counters, array shapes, indices), where a larger
one would overflow long after the config loaded. Every ``int`` of a
:class:`~levanter_core.config.base.ConfigModel` is bounded to ``-MAX_INT .. MAX_INT`` (within its
own ``ge``/``gt`` bounds) unless its type sets an upper bound of its own."""

MAX_SEED = 2**32 - 1
"""The largest seed: JAX's random keys hold 32 bits of a seed (without 64-bit mode), so seeds
beyond it would silently repeat smaller ones."""


def not_a_bool(value: Any) -> Any:
    """Refuse ``true``/``false`` where a number is meant (pydantic would read them as 1 and 0)."""
    if isinstance(value, bool):
        raise PydanticCustomError("bool_not_number", "expected a number, not true/false")
    return value


def whole_number(low: int, high: int, why: str) -> Any:
    """The type of an ``int`` field that takes ``low .. high``, refusing anything else with a
    message that gives the range and ``why`` it is what it is. Unlike a plain ``int`` (bounded to
    :data:`MAX_INT`), ``high`` may be larger."""

    def check(value: int) -> int:
        if not low <= value <= high:
            raise PydanticCustomError(
                "int_range",
                "expected a whole number from {low} to {high} ({why})",
                {"low": low, "high": high, "why": why},
            )
        return value

    check.__levanter_int_range__ = (low, high)  # type: ignore[attr-defined]  # a marker ConfigModel reads: it adds no bound of its own
    return Annotated[int, AfterValidator(check)]


Seed = whole_number(0, MAX_SEED, "the seeds JAX's random keys tell apart")
"""A random seed: ``0 .. 2^32 - 1``."""

LargeCount = whole_number(1, 2**63 - 1, "a count of tokens or bytes, which Python works with, up to 2^63 - 1")
"""A positive count that may exceed :data:`MAX_INT` because it never becomes a JAX integer: tokens
of a whole training run, bytes."""


_DURATION_UNITS = {
    "ms": 0.001,
    "s": 1,
    "sec": 1,
    "secs": 1,
    "second": 1,
    "seconds": 1,
    "m": 60,
    "min": 60,
    "mins": 60,
    "minute": 60,
    "minutes": 60,
    "h": 3600,
    "hr": 3600,
    "hour": 3600,
    "hours": 3600,
    "d": 86400,
    "day": 86400,
    "days": 86400,
}
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*")


def parse_duration(value: Any) -> datetime.timedelta:
    """``'5m'``, ``'30s'``, ``'1h30m'``, ``'15 minutes'``, a number of seconds, or a timedelta."""
    if isinstance(value, datetime.timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like '30s' or '15m', got {value!r}")
    if isinstance(value, (int, float)):
        return datetime.timedelta(seconds=value)
    if isinstance(value, str):
        text = value.strip()
        pos, seconds = 0, 0.0
        while pos < len(text):
            m = _DURATION_PART.match(text, pos)
            if not m or m.group(2).lower() not in _DURATION_UNITS:
                break
            seconds += float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
            pos = m.end()
        if text and pos == len(text):
            return datetime.timedelta(seconds=seconds)
    raise ValueError(f"expected a duration like '30s', '5m', '1h' or '15 minutes', got {value!r}")


def format_duration(value: datetime.timedelta) -> str:
    seconds = value.total_seconds()
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


Duration = Annotated[datetime.timedelta, BeforeValidator(parse_duration), PlainSerializer(format_duration)]


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: Any) -> int:
    """A number of bytes written as ``512MB``, ``1GiB``, ``2gb`` or a plain positive number."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"expected a positive size, got {value}")
        return value
    m = _SIZE.fullmatch(str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"expected a size such as 512MB or 1GiB, got {value!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_mp_policy(value: Any) -> str:
    """Check a jmp policy string such as ``p=f32,c=bfloat16`` (or just ``f32``)."""
    if not isinstance(value, str):
        raise ValueError(f"expected a precision policy like 'p=f32,c=bfloat16', got {value!r}")
    try:
        jmp.get_policy(value)
    except Exception as e:
        raise ValueError(
            f"invalid precision policy {value!r} ({e}); write it as 'p=f32,c=bfloat16' "
            "(p: parameters, c: compute, o: output; dtypes f32, bf16/bfloat16, f16)"
        ) from None
    return value


MpPolicy = Annotated[str, BeforeValidator(parse_mp_policy)]


ContextAttention = Literal["ring", "all_gather"]
"""How attention runs when each sequence's positions are split over devices
(``trainer.context_attention``; :mod:`levanter_core.layers.context_parallel`)."""
