"""Gemma 3 (Gemma Team, 2025), the text-only decoder (Hugging Face's ``Gemma3ForCausalLM``,
``model_type: gemma3_text``).

Gemma 2's layer (a ``1 + weight`` RMSNorm on each side of both sublayers), with:

* RMSNorm of every query and key head over ``head_dim`` (also ``1 + weight``), after
  the projections and before the rotation;
* five local layers to one global (``sliding_window_pattern: 6``), or any arrangement
  through ``layer_types``;
* two rotary embeddings: local layers use plain RoPE with base ``rope_local_base_freq``,
  global layers use ``rope`` (base 1e6, linearly scaled in the 4B and larger models);
* no soft-capping of attention scores, and none of the output logits unless
  ``final_logit_softcapping`` is set.

The multimodal checkpoints (``Gemma3ForConditionalGeneration``, ``model_type: gemma3``)
keep the language model under other tensor names beside a vision tower; they are not
read here.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from haliax import Axis
from pydantic import PositiveFloat, PositiveInt

from levanter_core.layers import AttentionConfig, DefaultRotaryConfig, RotaryConfig, rotary_from_hf
from levanter_model_gemma.gemma import GEMMA_NORM_OFFSET, GemmaLMHeadModel
from levanter_model_gemma.gemma2 import Gemma2Config, Gemma2DecoderLayer

_GLOBAL_THETA = 1_000_000.0
_LOCAL_THETA = 10_000.0


class Gemma3Config(Gemma2Config):
    """The ``model:`` section for ``type: gemma3``. Defaults are Gemma 3 1B's."""

    type: str = "gemma3"
    """The registered type name."""
    default_hf_checkpoint: ClassVar[str | None] = "google/gemma-3-1b-pt"
    """What ``initialize_from_hf: true`` loads without ``reference_checkpoint`` (Levanter's default)."""

    hf_architecture: ClassVar[str] = "Gemma3ForCausalLM"
    hf_model_type: ClassVar[str] = "gemma3_text"

    seq_len: PositiveInt = 32768
    """Length of the training sequences (Hugging Face's ``max_position_embeddings``)."""

    hidden_dim: PositiveInt = 1152
    """Width of the residual stream (``hidden_size``)."""

    intermediate_dim: PositiveInt = 6912
    """Width of the MLP's hidden layer (``intermediate_size``)."""

    num_heads: PositiveInt = 4
    """Number of query heads."""

    num_kv_heads: PositiveInt = 1
    """Number of key/value heads; must divide ``num_heads``."""

    sliding_window: PositiveInt | None = 512
    """Local layers let each token attend to itself and the ``sliding_window - 1`` tokens
    before it; ``None`` makes every layer global."""

    sliding_window_pattern: PositiveInt = 6
    """Every ``sliding_window_pattern``-th layer (counting from 1) is global, the others
    local; ignored when ``layer_types`` is set."""

    rope: RotaryConfig = DefaultRotaryConfig(theta=_GLOBAL_THETA)
    """Rotary embedding of the global layers and its scaling (``{type: linear, factor: 8}``
    in the 4B and larger models)."""

    rope_local_base_freq: PositiveFloat = _LOCAL_THETA
    """Base wavelength of the local layers' rotary embedding (never scaled)."""

    attn_logit_softcapping: None = None
    """Gemma 3 does not soft-cap attention scores; always ``null``."""

    final_logit_softcapping: PositiveFloat | None = None
    """Output logits become ``cap * tanh(logit / cap)``; ``None`` (Gemma 3's choice) turns it off."""

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(
            super().attention_config(),
            qk_norm="head",
            qk_norm_eps=self.layer_norm_epsilon,
            qk_norm_offset=GEMMA_NORM_OFFSET,
            local_rope=DefaultRotaryConfig(theta=self.rope_local_base_freq),
        )

    def build(self, Vocab: Axis, *, key) -> GemmaLMHeadModel:
        return GemmaLMHeadModel.init(Vocab, self, key=key, layer_cls=Gemma2DecoderLayer)

    # -- Hugging Face -------------------------------------------------------------------------
    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        if hf.get("model_type") == "gemma3":
            raise ValueError(
                "model_type 'gemma3' is the multimodal Gemma3ForConditionalGeneration (text and vision); "
                "only the text-only Gemma3ForCausalLM (model_type 'gemma3_text', e.g. gemma-3-1b) can be imported. "
                "Convert its language model to a Gemma3ForCausalLM checkpoint first."
            )
        fields = super().hf_fields(hf)
        # transformers reads Gemma 3's attention soft cap but never applies it
        del fields["attn_logit_softcapping"]
        if hf.get("layer_types") is None:  # configs written before layer_types existed
            fields["sliding_window_pattern"] = hf.get("sliding_window_pattern", 6)
        return {
            **fields,
            "final_logit_softcapping": hf.get("final_logit_softcapping"),
            **_ropes_from_hf(hf),
        }

    def to_hf_config(self, vocab_size: int) -> dict:
        config = super().to_hf_config(vocab_size)
        del config["attn_logit_softcapping"]
        config["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_local_base_freq},
            "full_attention": self.rope.to_hf(),
        }
        return config


def _ropes_from_hf(hf: dict) -> dict:
    """``rope`` and ``rope_local_base_freq`` from Hugging Face's nested ``rope_parameters``
    (``{"sliding_attention": {...}, "full_attention": {...}}``), or from the older
    ``rope_theta``, ``rope_scaling`` and ``rope_local_base_freq`` keys."""
    params = hf.get("rope_parameters")
    if params is None:
        global_params = {"rope_theta": hf.get("rope_theta", _GLOBAL_THETA), **(hf.get("rope_scaling") or {})}
        local_params = {"rope_theta": hf.get("rope_local_base_freq", _LOCAL_THETA)}
    else:
        global_params = params.get("full_attention") or {}
        local_params = params.get("sliding_attention") or {}
    local_type = local_params.get("rope_type") or local_params.get("type") or "default"
    if local_type != "default":
        raise ValueError(
            f"rope_parameters.sliding_attention: rope type {local_type!r} is not supported, only 'default'"
        )
    # both through rotary_from_hf, which refuses what either may hold that we do not implement
    local = rotary_from_hf(local_params, default_theta=_LOCAL_THETA, hf_config=hf)
    return {
        "rope": rotary_from_hf(global_params, default_theta=_GLOBAL_THETA, hf_config=hf),
        "rope_local_base_freq": local.theta,
    }
