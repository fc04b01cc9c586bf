"""Qwen 3 (Qwen team, 2025): the Qwen 2 decoder of :mod:`levanter_model_qwen3.qwen` with
a different attention layer.

* Queries and keys are RMS-normalized per head, over ``head_dim``, after the projection
  and before the rotation (``self_attn.q_norm`` / ``k_norm``, one weight of ``head_dim``
  shared by all heads). Values are not normalized.
* ``head_dim`` is its own setting (128 in every released size), so the query projection
  may be wider or narrower than the residual stream.
* No biases, unless ``use_bias`` (Hugging Face's ``attention_bias``) puts them on all
  four projections.

The sliding window works as in Qwen 2. Only the config differs: the modules are Qwen 2's,
built from this config's :meth:`Qwen3Config.attention_config`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pydantic import NonNegativeInt, PositiveInt

from levanter_core.layers import AttentionConfig
from levanter_model_qwen3.qwen import QwenConfig

# Hugging Face's Qwen3Config default, for a config.json without the key
_HF_HEAD_DIM = 128


class Qwen3Config(QwenConfig):
    """The ``model:`` section for ``type: qwen3``. Defaults are Qwen3-8B's."""

    type: str = "qwen3"
    """The registered type name."""

    hf_architecture: ClassVar[str] = "Qwen3ForCausalLM"
    hf_model_type: ClassVar[str] = "qwen3"

    hidden_dim: PositiveInt = 4096
    """Width of the residual stream (``hidden_size``)."""

    intermediate_dim: PositiveInt = 12288
    """Width of the MLP's hidden layer (``intermediate_size``)."""

    num_layers: PositiveInt = 36
    """Number of decoder layers (``num_hidden_layers``)."""

    num_heads: PositiveInt = 32
    """Number of query heads (``num_attention_heads``)."""

    num_kv_heads: PositiveInt = 8
    """Number of key/value heads (``num_key_value_heads``)."""

    head_dim: PositiveInt = _HF_HEAD_DIM
    """Size of each head, independent of ``hidden_dim``."""

    use_bias: bool = False
    """Biases on the query, key, value and output projections (``attention_bias``)."""

    max_window_layers: NonNegativeInt = 36
    """With ``use_sliding_window``, layers ``0 .. max_window_layers - 1`` attend to the
    whole sequence and the layers after them over the sliding window."""

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(
            super().attention_config(),
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            qk_norm="head",
            qk_norm_eps=self.layer_norm_epsilon,
        )

    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        return {
            **super().hf_fields(hf),
            "head_dim": hf.get("head_dim") or _HF_HEAD_DIM,
            "use_bias": hf.get("attention_bias", False),
        }

    def to_hf_config(self, vocab_size: int) -> dict:
        return {**super().to_hf_config(vocab_size), "attention_bias": self.use_bias}
