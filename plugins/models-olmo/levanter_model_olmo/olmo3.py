"""OLMo 3 (Olmo Team, 2025): OLMo 2's post-norm decoder with sliding-window attention in
three layers of every four.

What differs from OLMo 2:

* ``layer_types`` says which layers attend over a window of ``sliding_window`` tokens and
  which to the whole sequence (Hugging Face's default: every fourth layer full);
* the two kinds of layer have rotary embeddings of their own: ``rope`` for the full layers
  (YaRN-extended from 8,192 to 65,536 tokens in the released models), ``sliding_rope`` for the
  sliding ones, written as Hugging Face's nested ``rope_parameters`` (``{"full_attention": ...,
  "sliding_attention": ...}``). An older ``config.json``'s ``rope_scaling`` scales the full
  layers only, as in ``transformers``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pydantic import PositiveInt, model_validator

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import AttentionConfig, DefaultRotaryConfig, RotaryConfig, YarnRotaryConfig, rotary_from_hf
from levanter_core.models.decoder import LayerType
from levanter_model_olmo.olmo2 import Olmo2Config

_HF_THETA = 500000.0


class Olmo3Config(Olmo2Config):
    """The ``model:`` section for ``type: olmo3``. Defaults are Olmo-3-1025-7B's."""

    type: str = "olmo3"
    default_hf_checkpoint = "allenai/Olmo-3-1025-7B"

    hf_architecture = "Olmo3ForCausalLM"
    hf_model_type = "olmo3"
    hf_keys: ClassVar = {
        **Olmo2Config.hf_keys,
        "sliding_window": HfKey("sliding_window", 4096),
        "layer_types": HfKey(
            "layer_types",
            None,
            read=lambda v, hf: None if v is None else tuple(v),
            write=lambda v, c: list(c.attention_types()),
        ),
    }

    seq_len: PositiveInt = 65536

    rope: RotaryConfig = YarnRotaryConfig(theta=_HF_THETA, factor=8.0, original_max_position_embeddings=8192)
    """Rotary embedding of the full-attention layers (``sliding_rope`` is the sliding ones'):
    ``{type: default|linear|llama3|yarn|longrope|dynamic, theta: ...}``. OLMo 3 7B pretrains at
    8,192 tokens and extends to 65,536 with YaRN (``factor: 8``)."""

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
        """``(rope, sliding_rope)`` as ``transformers`` 5 reads them: ``rope_parameters`` has one
        entry per kind of layer; an older file's ``rope_scaling`` and top-level ``rope_theta``
        apply to the full layers only; a missing entry or theta is plain RoPE of 500000."""
        params = hf.get("rope_parameters") or {}
        if params and not params.keys() & {"full_attention", "sliding_attention"}:
            # transformers would ignore such a dictionary and rotate every layer plainly
            raise ValueError(
                f"rope_parameters {params} is a single rotary embedding; an {cls.hf_model_type} config.json "
                'gives one per kind of layer: {"full_attention": {...}, "sliding_attention": {...}}'
            )
        full = {**(params.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
        sliding = params.get("sliding_attention") or {}
        ropes = []
        # (Olmo3Config.convert_rope_params_to_dict hands rope_theta to the full layers and leaves
        # the sliding ones the class default; the released models use 500000 for both.)
        for part, theta in ((full, hf.get("rope_theta", _HF_THETA)), (sliding, _HF_THETA)):
            rope = rotary_from_hf(dict(part), default_theta=theta, hf_config=hf)
            _check_whole_heads(rope)
            ropes.append(rope)
        return tuple(ropes)

    def to_hf_config(self, vocab_size: int) -> dict:
        _check_whole_heads(self.sliding_rope)
        hf = super().to_hf_config(vocab_size)
        hf["rope_parameters"] = {"full_attention": self.rope.to_hf(), "sliding_attention": self.sliding_rope.to_hf()}
        return hf


def _check_whole_heads(rope) -> None:
    if rope.partial_rotary_factor != 1.0:
        raise ValueError(
            f"partial_rotary_factor = {rope.partial_rotary_factor} is not supported: "
            "Hugging Face's Olmo3ForCausalLM rotates whole heads"
        )
