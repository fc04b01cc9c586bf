"""Config field types that several of these optimizers share."""

from __future__ import annotations

from typing import Annotated, Any

import jax.numpy as jnp
from pydantic import BeforeValidator


def _float_dtype(value: Any) -> str | None:
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise ValueError(f"{value!r} is not a dtype; write a floating-point one such as float32 or bfloat16") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{value!r} is not a floating-point dtype; write one such as float32 or bfloat16")
    return dtype.name


FloatDtype = Annotated[str | None, BeforeValidator(_float_dtype)]
"""The name of a floating-point dtype (``float32``, ``bfloat16``), or None; any other value is
refused, naming it."""
