"""Tiny model configurations for tests: one source for the sizes that train or compare in
seconds on a CPU.

``tiny_model`` gives the ``model:`` section of a run config (our side); ``tiny_hf_config``
gives a ``transformers`` config object (the Hugging Face side), for a parity check or a
refusal test. Both take overrides for what a test varies.
"""

from __future__ import annotations

from typing import Any

TINY_MODEL: dict[str, Any] = {"type": "gpt2", "hidden_dim": 32, "num_heads": 2, "num_layers": 1, "seq_len": 32}
"""The fields of :func:`tiny_model`'s default: a one-layer GPT-2 of width 32."""

TINY_HF: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
"""The keys of :func:`tiny_hf_config`'s default: two decoder layers of width 64, four query
heads over two key-value heads, a vocabulary of 128 and room for 256 positions. A model this
size saves to more than one 64 KiB shard, so the sharded export is exercised."""


def tiny_model(**fields: Any) -> dict[str, Any]:
    """A ``model:`` section small enough to train a few steps on a CPU in seconds: a one-layer
    GPT-2 of width 32 over 32 positions (needs levanter-model-gpt2), with ``fields`` added or
    overridden (``type`` included, for another family's fields). Returns a new dict."""
    return {**TINY_MODEL, **fields}


def tiny_hf_config(config_class: Any, **overrides: Any) -> Any:
    """A ``transformers`` decoder config of class ``config_class`` (``transformers.LlamaConfig``,
    ``Qwen3MoeConfig``, ...) with :data:`TINY_HF`'s sizes and ``overrides`` on top (a key set to
    ``None`` is passed as ``None``, which leaves it to the class's own default for most keys).
    Returns the config object."""
    return config_class(**{**TINY_HF, **overrides})
