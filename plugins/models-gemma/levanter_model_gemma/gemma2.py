"""Gemma 2 (Gemma Team, 2024b): Gemma with a norm on each side of both sublayers,
alternating local (sliding-window) and global attention, and soft-capped logits.

Relative to Gemma 1:

* each layer is ``x + norm(attn(norm(x)))`` then ``x + norm(mlp(norm(x)))`` (four
  ``1 + weight`` RMSNorms: ``input_layernorm``, ``post_attention_layernorm``,
  ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``);
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` rather than
  ``head_dim ** -0.5``, then soft-capped, ``cap * tanh(s / cap)``, before masking;
* layers alternate between a window of ``sliding_window`` tokens (even indices) and
  the whole sequence (``layer_types`` spells out any other arrangement);
* the output logits are soft-capped too (``final_logit_softcapping``), in the model and
  in the training loss.

Embeddings, final norm and head are Gemma's (:mod:`levanter_model_gemma.gemma`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from pydantic import PositiveFloat, PositiveInt, model_validator

from levanter_core.layers import Attention, AttentionConfig, AttentionMask, GatedMlp, RmsNorm
from levanter_model_gemma.gemma import GemmaConfig, GemmaLMHeadModel, gemma_mlp, gemma_norm

LayerType = Literal["sliding_attention", "full_attention"]
"""How one layer attends, in Hugging Face's words: through the sliding window, or to the whole sequence."""


class Gemma2Config(GemmaConfig):
    """The ``model:`` section for ``type: gemma2``. Defaults are Gemma 2 2B's."""

    type: str = "gemma2"
    """The registered type name."""
    default_hf_checkpoint: ClassVar[str | None] = "google/gemma-2-2b"
    """What ``initialize_from_hf: true`` loads without ``reference_checkpoint`` (Levanter's default)."""

    hf_architecture: ClassVar[str] = "Gemma2ForCausalLM"
    hf_model_type: ClassVar[str] = "gemma2"

    hidden_dim: PositiveInt = 2304
    """Width of the residual stream (``hidden_size``)."""

    intermediate_dim: PositiveInt = 9216
    """Width of the MLP's hidden layer (``intermediate_size``)."""

    num_layers: PositiveInt = 26
    """Number of decoder layers."""

    num_heads: PositiveInt = 8
    """Number of query heads."""

    num_kv_heads: PositiveInt = 4
    """Number of key/value heads (grouped-query attention); must divide ``num_heads``."""

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

    def resolved_layer_types(self) -> tuple[LayerType, ...]:
        """``layer_types``, or the ones ``sliding_window_pattern`` implies."""
        if self.layer_types is not None:
            return self.layer_types
        pattern = self.sliding_window_pattern
        return tuple(
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(self.num_layers)
        )

    def sliding_layers(self) -> NamedArray:
        flags = [t == "sliding_attention" for t in self.resolved_layer_types()]
        return hax.named(jnp.asarray(flags), self.Layers)

    @property
    def final_logit_soft_cap(self) -> float | None:
        return self.final_logit_softcapping

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(
            super().attention_config(),
            scale=self.query_pre_attn_scalar**-0.5,
            logits_soft_cap=self.attn_logit_softcapping,
            sliding_window=self.sliding_window,
        )

    def build(self, Vocab: Axis, *, key) -> GemmaLMHeadModel:
        return GemmaLMHeadModel.init(Vocab, self, key=key, layer_cls=Gemma2DecoderLayer)

    # -- Hugging Face -------------------------------------------------------------------------
    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        layer_types = hf.get("layer_types")
        return {
            **super().hf_fields(hf),
            # Gemma 2 and 3 read `hidden_activation`; a leftover `hidden_act` is ignored, as in transformers
            "activation_function": hf.get("hidden_activation") or "gelu_pytorch_tanh",
            "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
            "sliding_window": hf.get("sliding_window", 4096),
            "layer_types": tuple(layer_types) if layer_types is not None else None,
            "attn_logit_softcapping": hf.get("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0),
        }

    def to_hf_config(self, vocab_size: int) -> dict:
        config = super().to_hf_config(vocab_size)
        config["hidden_activation"] = config.pop("hidden_act")
        return {
            **config,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.resolved_layer_types()),
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
        }


class Gemma2DecoderLayer(eqx.Module):
    """``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``. Gemma 3 uses it too."""

    self_attn: Attention
    mlp: GatedMlp
    input_layernorm: RmsNorm
    post_attention_layernorm: RmsNorm
    pre_feedforward_layernorm: RmsNorm
    post_feedforward_layernorm: RmsNorm

    @staticmethod
    def init(config: Gemma2Config, *, key) -> "Gemma2DecoderLayer":
        k_attn, k_mlp = jax.random.split(key, 2)
        return Gemma2DecoderLayer(
            Attention.init(config.attention_config(), key=k_attn),
            gemma_mlp(config, key=k_mlp),
            gemma_norm(config),
            gemma_norm(config),
            gemma_norm(config),
            gemma_norm(config),
        )

    def __call__(self, x: NamedArray, mask: AttentionMask, sliding=None) -> NamedArray:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, sliding=sliding))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
