"""The settings of the layers that run split over devices, entered around a step's tracing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from levanter_core.config.types import ContextAttention
from levanter_core.layers.context_parallel import context_attention
from levanter_core.layers.expert_parallel import expert_capacity
from levanter_core.layers.pipeline import pipeline_microbatches as microbatches
from levanter_core.layers.pipeline import pipeline_repeats as repeats


@contextlib.contextmanager
def parallel_settings(
    *,
    context_attention_strategy: ContextAttention = "ring",
    expert_capacity_factor: float | None = None,
    pipeline_microbatches: int | None = None,
    pipeline_repeats: int = 1,
) -> Iterator[None]:
    """Trace inside this block with context-parallel attention computed by
    ``context_attention_strategy`` (``trainer.context_attention``), expert-parallel layers
    exchanging tokens with ``expert_capacity_factor`` (``trainer.expert_capacity_factor``; None:
    dropless) and pipelines fed ``pipeline_microbatches`` microbatches
    (``trainer.pipeline_microbatches``; None: their default) in ``pipeline_repeats`` rounds
    (``trainer.pipeline_repeats``; 1: GPipe's schedule, more: the circular one)."""
    with (
        context_attention(context_attention_strategy),
        expert_capacity(expert_capacity_factor),
        microbatches(pipeline_microbatches),
        repeats(pipeline_repeats),
    ):
        yield


__all__ = ["parallel_settings"]
