"""The settings of the layers that run split over devices, entered around a step's tracing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from levanter_core.config.types import ContextAttention
from levanter_core.layers.context_parallel import context_attention
from levanter_core.layers.expert_parallel import expert_capacity


@contextlib.contextmanager
def parallel_settings(
    *, context_attention_strategy: ContextAttention = "ring", expert_capacity_factor: float | None = None
) -> Iterator[None]:
    """Trace inside this block with context-parallel attention computed by
    ``context_attention_strategy`` (``trainer.context_attention``) and expert-parallel layers
    exchanging tokens with ``expert_capacity_factor`` (``trainer.expert_capacity_factor``; None:
    dropless)."""
    with context_attention(context_attention_strategy), expert_capacity(expert_capacity_factor):
        yield


__all__ = ["parallel_settings"]
