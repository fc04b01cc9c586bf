"""Value types written the way the configuration guide writes them."""

from __future__ import annotations

import datetime
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

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
    import jmp

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
