"""The settings of the layers that run split over devices, entered around a step's tracing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from levanter_core.config.types import ContextAttention
from levanter_core.layers.context_parallel import context_attention
from levanter_core.layers.expert_parallel import expert_capacity
from levanter_core.layers.pipeline import pipeline_microbatches as microbatches


@contextlib.contextmanager
def parallel_settings(
    *,
    context_attention_strategy: ContextAttention = "ring",
    expert_capacity_factor: float | None = None,
    pipeline_microbatches: int | None = None,
) -> Iterator[None]:
    """Trace inside this block with context-parallel attention computed by
    ``context_attention_strategy`` (``trainer.context_attention``), expert-parallel layers
    exchanging tokens with ``expert_capacity_factor`` (``trainer.expert_capacity_factor``; None:
    dropless) and pipelines fed ``pipeline_microbatches`` microbatches
    (``trainer.pipeline_microbatches``; None: their default)."""
    with (
        context_attention(context_attention_strategy),
        expert_capacity(expert_capacity_factor),
        microbatches(pipeline_microbatches),
    ):
        yield


__all__ = ["parallel_settings"]
