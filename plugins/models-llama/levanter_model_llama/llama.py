"""Llama 1, 2 and 3 (Touvron et al., 2023; Meta, 2024): the kit's common decoder as it is.

A pre-norm decoder: RMSNorm, grouped-query attention with rotary embeddings, RMSNorm,
SwiGLU MLP, each added to the residual stream; a final RMSNorm and an output projection
that may be tied to the token embeddings. Llama 3.1's long-context scaling is
``rope: {type: llama3}``. Everything is :class:`~levanter_core.models.decoder.DecoderConfig`'s;
this file adds Llama's optional biases, Levanter's ``use_layer_norm_weight``, and the
defaults of Llama 2 7B.
"""

from __future__ import annotations

import dataclasses

from pydantic import Field

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import AttentionConfig, RmsNorm
from levanter_core.models.decoder import DecoderConfig, DecoderLM


class LlamaConfig(DecoderConfig):
    """The ``model:`` section for ``type: llama``. Defaults are Llama 2 7B's."""

    type: str = "llama"
    default_hf_checkpoint = "NousResearch/Llama-2-7b-hf"

    hf_architecture = "LlamaForCausalLM"
    hf_model_type = "llama"
    hf_keys = {
        **DecoderConfig.hf_keys,
        "use_bias": HfKey("attention_bias", False),
    }
    hf_refused = {"mlp_bias": (False, None)}

    layer_norm_epsilon: float = Field(1e-5, gt=0.0)
    """Epsilon of every RMSNorm (``rms_norm_eps``)."""

    use_bias: bool = False
    """Biases on the attention projections (``attention_bias``)."""

    use_layer_norm_weight: bool = True
    """Whether the RMSNorms have a learned scale. False: plain normalization, no parameter
    (as in Levanter's OLMo-style ablations); such a model has no Hugging Face counterpart."""

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(super().attention_config(), qkv_bias=self.use_bias, out_bias=self.use_bias)

    def norm(self, axis=None) -> RmsNorm:
        return RmsNorm.init(axis or self.Embed, eps=self.layer_norm_epsilon, use_weight=self.use_layer_norm_weight)

    def to_hf_config(self, vocab_size: int) -> dict:
        return {**super().to_hf_config(vocab_size), "mlp_bias": False}


LlamaLMHeadModel = DecoderLM
"""A Llama model is the kit's :class:`~levanter_core.models.decoder.DecoderLM` (the name is kept)."""
