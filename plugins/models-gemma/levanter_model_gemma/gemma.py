"""Gemma (Gemma Team, 2024): the kit's decoder with four differences that matter for exact
results:

* the token embeddings are multiplied by ``sqrt(hidden_dim)`` on the way in (rounded to the
  compute dtype first, as Hugging Face does), while the tied output projection uses the
  unscaled matrix;
* every RMSNorm scales by ``1 + weight``, and checkpoints store ``weight`` (zero at
  initialization);
* the gated MLP uses the tanh approximation of GELU (GeGLU);
* ``head_dim`` is set independently of ``hidden_dim / num_heads``, and the smaller models
  use multi-query attention (one key/value head).

Gemma 2 and 3 (:mod:`levanter_model_gemma.gemma2`, :mod:`levanter_model_gemma.gemma3`)
change the norms' placement and the attention settings.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import Field, PositiveInt

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import ActivationName, AttentionConfig
from levanter_core.models.decoder import DecoderConfig, DecoderLM

GEMMA_NORM_OFFSET = 1.0
"""Gemma's RMSNorms scale by ``1 + weight``."""


def _tanh_gelu(value, hf):
    # The original Gemma 1 configs say "gelu" but the models were trained with the tanh
    # approximation; transformers makes the same substitution.
    value = value or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if value == "gelu" else value


class GemmaConfig(DecoderConfig):
    """The ``model:`` section for ``type: gemma``. Defaults are Gemma 2B's."""

    type: str = "gemma"
    default_hf_checkpoint = "google/gemma-2b"

    hf_architecture = "GemmaForCausalLM"
    hf_model_type = "gemma"
    hf_keys: ClassVar = {
        **DecoderConfig.hf_keys,
        "head_dim": HfKey("head_dim", 256, read=lambda v, hf: v or 256),
        "activation_function": HfKey("hidden_act", None, read=_tanh_gelu),
        "tie_word_embeddings": HfKey("tie_word_embeddings", True),
        "use_bias": HfKey("attention_bias", False),
    }
    hf_refused: ClassVar = {"use_bidirectional_attention": (False, None), "attention_dropout": (0, 0.0)}
    norm_offset = GEMMA_NORM_OFFSET

    seq_len: PositiveInt = 8192
    hidden_dim: PositiveInt = 2048
    intermediate_dim: PositiveInt = 16384
    num_layers: PositiveInt = 18
    num_heads: PositiveInt = 8
    num_kv_heads: PositiveInt = 1
    layer_norm_epsilon: float = Field(1e-6, gt=0.0)
    tie_word_embeddings: bool = True

    head_dim: PositiveInt = 256
    """Size of each attention head; independent of ``hidden_dim / num_heads``."""

    activation_function: ActivationName = "gelu_pytorch_tanh"
    """Nonlinearity of the gated MLP (the tanh approximation of GELU)."""

    use_bias: bool = False
    """Biases on the attention projections (``attention_bias``)."""

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(super().attention_config(), qkv_bias=self.use_bias, out_bias=self.use_bias)

    def embedding_multiplier(self, dtype) -> jax.Array:
        return embedding_scale(self.hidden_dim, dtype)


def embedding_scale(hidden_dim: int, dtype) -> jax.Array:
    """The factor Gemma multiplies its input embeddings by: ``sqrt(hidden_dim)``, rounded to
    float32 and then to the compute dtype, as Hugging Face does (55.5, not 55.43, for
    hidden 3072 in bfloat16)."""
    return jnp.asarray(np.float32(math.sqrt(hidden_dim)), dtype=dtype)


GemmaLMHeadModel = DecoderLM
"""A Gemma model is the kit's :class:`~levanter_core.models.decoder.DecoderLM` (the name is kept)."""
