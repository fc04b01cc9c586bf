"""OLMo 3 (Olmo Team, 2025): OLMo 2's post-norm decoder with sliding-window attention in
three layers of every four.

What differs from OLMo 2:

* ``layer_types`` says which layers attend over a window of ``sliding_window`` tokens and
  which to the whole sequence (Hugging Face's default: every fourth layer full);
* the two kinds of layer have rotary embeddings of their own: ``rope`` for the full layers
  (YaRN-extended in the long-context models), ``sliding_rope`` for the sliding ones, written
  as Hugging Face's nested ``rope_parameters`` (``{"full_attention": ..., "sliding_attention":
  ...}``).
"""

from __future__ import annotations

import dataclasses

from pydantic import PositiveInt, model_validator

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import AttentionConfig, DefaultRotaryConfig, RotaryConfig, rotary_from_hf
from levanter_core.models.decoder import LayerType
from levanter_model_olmo.olmo2 import Olmo2Config

_HF_THETA = 500000.0


class Olmo3Config(Olmo2Config):
    """The ``model:`` section for ``type: olmo3``. Defaults are Olmo-3-1025-7B's."""

    type: str = "olmo3"
    default_hf_checkpoint = "allenai/Olmo-3-1025-7B"

    hf_architecture = "Olmo3ForCausalLM"
    hf_model_type = "olmo3"
    hf_keys = {
        **Olmo2Config.hf_keys,
        "sliding_window": HfKey("sliding_window", 4096),
        "layer_types": HfKey("layer_types", None, read=lambda v, hf: tuple(v) if v is not None else None,
                             write=lambda v, c: list(c.attention_types())),  # fmt: skip
    }

    seq_len: PositiveInt = 65536
    intermediate_dim: PositiveInt = 11008

    sliding_window: PositiveInt = 4096
    """Sliding layers let each token attend to itself and the ``sliding_window - 1`` tokens before it."""

    layer_types: tuple[LayerType, ...] | None = None
    """Each layer's attention, ``sliding_attention`` or ``full_attention`` (one entry per layer);
    None: every fourth layer full, the others sliding."""

    sliding_rope: RotaryConfig = DefaultRotaryConfig(theta=_HF_THETA)
    """Rotary embedding of the sliding layers (``rope`` is the full layers')."""

    @model_validator(mode="after")
    def _one_type_per_layer(self):
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_layers is {self.num_layers}; "
                "give one per layer"
            )
        return self

    def attention_types(self) -> tuple[LayerType, ...]:
        if self.layer_types is not None:
            return self.layer_types
        return tuple("full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(self.num_layers))

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(super().attention_config(), local_rope=self.sliding_rope)

    @classmethod
    def rope_from_hf(cls, hf: dict):
        return cls._ropes(hf)[0]

    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        return {**super().hf_fields(hf), "sliding_rope": cls._ropes(hf)[1]}

    @classmethod
    def _ropes(cls, hf: dict):
        """``(rope, sliding_rope)`` from the nested ``rope_parameters`` (or a flat one for both)."""
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = hf.get("rope_theta", _HF_THETA)
        full = params.get("full_attention", params) if isinstance(params, dict) else {}
        sliding = params.get("sliding_attention", params) if isinstance(params, dict) else {}
        ropes = []
        for part in (full, sliding):
            rope = rotary_from_hf(dict(part), default_theta=theta, hf_config=hf)
            if rope.partial_rotary_factor != 1.0:
                raise ValueError(
                    f"partial_rotary_factor = {rope.partial_rotary_factor} is not supported: "
                    "Hugging Face's Olmo3ForCausalLM rotates whole heads"
                )
            ropes.append(rope)
        return tuple(ropes)

    def to_hf_config(self, vocab_size: int) -> dict:
        hf = super().to_hf_config(vocab_size)
        hf["rope_parameters"] = {"full_attention": self.rope.to_hf(), "sliding_attention": self.sliding_rope.to_hf()}
        return hf
