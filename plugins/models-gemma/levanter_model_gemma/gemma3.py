"""Gemma 3 (Gemma Team, 2025), the text-only decoder (Hugging Face's ``Gemma3ForCausalLM``,
``model_type: gemma3_text``).

Gemma 2's layer (a ``1 + weight`` RMSNorm on each side of both sublayers), with:

* RMSNorm of every query and key head over ``head_dim`` (also ``1 + weight``), after the
  projections and before the rotation;
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

from pydantic import PositiveFloat, PositiveInt

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import AttentionConfig, DefaultRotaryConfig, RotaryConfig, rotary_from_hf
from levanter_model_gemma.gemma import GEMMA_NORM_OFFSET
from levanter_model_gemma.gemma2 import Gemma2Config

_GLOBAL_THETA = 1_000_000.0
_LOCAL_THETA = 10_000.0


class Gemma3Config(Gemma2Config):
    """The ``model:`` section for ``type: gemma3``. Defaults are Gemma 3 1B's."""

    type: str = "gemma3"
    default_hf_checkpoint = "google/gemma-3-1b-pt"

    hf_architecture = "Gemma3ForCausalLM"
    hf_model_type = "gemma3_text"
    hf_keys: ClassVar = {
        # transformers reads Gemma 3's attention soft cap but never applies it
        **{k: v for k, v in Gemma2Config.hf_keys.items() if k != "attn_logit_softcapping"},
        "final_logit_softcapping": HfKey("final_logit_softcapping", None),
    }

    seq_len: PositiveInt = 32768
    hidden_dim: PositiveInt = 1152
    intermediate_dim: PositiveInt = 6912
    num_heads: PositiveInt = 4
    num_kv_heads: PositiveInt = 1
    sliding_window: PositiveInt | None = 512
    sliding_window_pattern: PositiveInt = 6

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

    # -- Hugging Face -------------------------------------------------------------------------
    @classmethod
    def rope_from_hf(cls, hf: dict):
        return _ropes_from_hf(hf)["rope"]

    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        if hf.get("model_type") == "gemma3":
            raise ValueError(
                "model_type 'gemma3' is the multimodal Gemma3ForConditionalGeneration (text and vision); "
                "only the text-only Gemma3ForCausalLM (model_type 'gemma3_text', e.g. gemma-3-1b) can be imported. "
                "Convert its language model to a Gemma3ForCausalLM checkpoint first."
            )
        fields = super().hf_fields(hf)
        if hf.get("layer_types") is None:  # configs written before layer_types existed
            fields["sliding_window_pattern"] = hf.get("sliding_window_pattern", 6)
        return {**fields, "rope_local_base_freq": _ropes_from_hf(hf)["rope_local_base_freq"]}

    def to_hf_config(self, vocab_size: int) -> dict:
        config = super().to_hf_config(vocab_size)
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
    ropes = {}
    # both through rotary_from_hf, which refuses what either may hold that we do not implement
    for name, part, theta in (("rope", global_params, _GLOBAL_THETA), ("local", local_params, _LOCAL_THETA)):
        rope = rotary_from_hf(part, default_theta=theta, hf_config=hf)
        if rope.partial_rotary_factor != 1.0:
            raise ValueError(
                f"partial_rotary_factor = {rope.partial_rotary_factor} is not supported: "
                "Hugging Face's Gemma3ForCausalLM rotates whole heads"
            )
        ropes[name] = rope
    return {"rope": ropes["rope"], "rope_local_base_freq": ropes["local"].theta}
