"""Qwen 3 (Qwen team, 2025): the Qwen 2 decoder of :mod:`levanter_model_qwen3.qwen` with
a different attention layer.

* Queries and keys are RMS-normalized per head, over ``head_dim``, after the projection
  and before the rotation (``self_attn.q_norm`` / ``k_norm``, one weight of ``head_dim``
  shared by all heads). Values are not normalized.
* ``head_dim`` is its own setting (128 in every released size), so the query projection
  may be wider or narrower than the residual stream.
* No biases, unless ``use_bias`` (Hugging Face's ``attention_bias``) puts them on all
  four projections.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pydantic import NonNegativeInt, PositiveInt

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import AttentionConfig
from levanter_model_qwen3.qwen import QwenConfig

# Hugging Face's Qwen3Config default, for a config.json without the key
_HF_HEAD_DIM = 128


class Qwen3Config(QwenConfig):
    """The ``model:`` section for ``type: qwen3``. Defaults are Qwen3-8B's."""

    type: str = "qwen3"

    hf_architecture = "Qwen3ForCausalLM"
    hf_model_type = "qwen3"
    hf_keys: ClassVar = {
        **QwenConfig.hf_keys,
        "head_dim": HfKey("head_dim", _HF_HEAD_DIM, read=lambda v, hf: v or _HF_HEAD_DIM),
        "use_bias": HfKey("attention_bias", False),
    }

    hidden_dim: PositiveInt = 4096
    intermediate_dim: PositiveInt = 12288
    num_layers: PositiveInt = 36
    num_heads: PositiveInt = 32
    num_kv_heads: PositiveInt = 8
    max_window_layers: NonNegativeInt = 36

    head_dim: PositiveInt = _HF_HEAD_DIM
    """Size of each head, independent of ``hidden_dim``."""

    use_bias: bool = False
    """Biases on the query, key, value and output projections (``attention_bias``)."""

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(
            super().attention_config(),
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            qk_norm="head",
            qk_norm_eps=self.layer_norm_epsilon,
        )
