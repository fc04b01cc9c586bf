"""Gemma 2 (Gemma Team, 2024b): Gemma with a norm on each side of both sublayers,
alternating local (sliding-window) and global attention, and soft-capped logits.

Relative to Gemma 1:

* sandwich norms: ``x + norm(attn(norm(x)))`` then ``x + norm(mlp(norm(x)))`` (four
  ``1 + weight`` RMSNorms per layer);
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` rather than
  ``head_dim ** -0.5``, then soft-capped, ``cap * tanh(s / cap)``, before masking;
* layers alternate between a window of ``sliding_window`` tokens (even indices) and the
  whole sequence (``layer_types`` spells out any other arrangement);
* the output logits are soft-capped too (``final_logit_softcapping``), in the model and in
  the training loss.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pydantic import PositiveFloat, PositiveInt, model_validator

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import AttentionConfig
from levanter_core.models.decoder import LayerType
from levanter_model_gemma.gemma import GemmaConfig


def _layer_types_in(value, hf):
    return tuple(value) if value is not None else None


class Gemma2Config(GemmaConfig):
    """The ``model:`` section for ``type: gemma2``. Defaults are Gemma 2 2B's."""

    type: str = "gemma2"
    default_hf_checkpoint = "google/gemma-2-2b"

    hf_architecture = "Gemma2ForCausalLM"
    hf_model_type = "gemma2"
    hf_keys: ClassVar = {
        **{k: v for k, v in GemmaConfig.hf_keys.items() if k != "activation_function"},
        # Gemma 2 and 3 read `hidden_activation`; a leftover `hidden_act` is ignored, as in transformers
        "activation_function": HfKey("hidden_activation", None, read=lambda v, hf: v or "gelu_pytorch_tanh"),
        "query_pre_attn_scalar": HfKey("query_pre_attn_scalar", 256),
        "sliding_window": HfKey("sliding_window", 4096),
        "layer_types": HfKey("layer_types", None, read=_layer_types_in, write=lambda v, c: list(c.attention_types())),
        "attn_logit_softcapping": HfKey("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": HfKey("final_logit_softcapping", 30.0),
    }
    norm_placement = "sandwich"

    hidden_dim: PositiveInt = 2304
    intermediate_dim: PositiveInt = 9216
    num_layers: PositiveInt = 26
    num_heads: PositiveInt = 8
    num_kv_heads: PositiveInt = 4

    query_pre_attn_scalar: PositiveInt = 256
    """Attention scores are multiplied by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``)."""

    sliding_window: PositiveInt | None = 4096
    """Local layers let each token attend to itself and the ``sliding_window - 1`` tokens
    before it; ``None`` makes every layer global."""

    sliding_window_pattern: PositiveInt = 2
    """Every ``sliding_window_pattern``-th layer (counting from 1) is global, the others
    local; ignored when ``layer_types`` is set."""

    layer_types: tuple[LayerType, ...] | None = None
    """Each layer's attention, ``sliding_attention`` or ``full_attention`` (one entry per
    layer), overriding ``sliding_window_pattern``."""

    attn_logit_softcapping: PositiveFloat | None = 50.0
    """Attention scores become ``cap * tanh(score / cap)`` before masking; ``None`` turns it off."""

    final_logit_softcapping: PositiveFloat | None = 30.0
    """Output logits become ``cap * tanh(logit / cap)``; ``None`` turns it off."""

    @model_validator(mode="after")
    def _check_layers(self):
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_layers is {self.num_layers}; "
                "give one per layer"
            )
        if self.attn_backend == "jax" and self.attn_logit_softcapping is not None:
            raise ValueError("attn_backend 'jax' cannot soft-cap attention logits; use 'auto' or 'reference'")
        return self

    def attention_types(self) -> tuple[LayerType, ...]:
        if self.layer_types is not None:
            return self.layer_types
        pattern = self.sliding_window_pattern
        kinds = ("sliding_attention", "full_attention")
        return tuple(kinds[(i + 1) % pattern == 0] for i in range(self.num_layers))

    def resolved_layer_types(self) -> tuple[LayerType, ...]:
        """``layer_types``, or the ones ``sliding_window_pattern`` implies."""
        return self.attention_types()

    @property
    def final_logit_soft_cap(self) -> float | None:
        return self.final_logit_softcapping

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(
            super().attention_config(),
            scale=self.query_pre_attn_scalar**-0.5,
            logits_soft_cap=self.attn_logit_softcapping,
        )
