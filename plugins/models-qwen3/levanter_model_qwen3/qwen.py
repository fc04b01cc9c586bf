"""Qwen 2 and Qwen 2.5 (Qwen team, 2024): the kit's common decoder with two differences:

* the query, key and value projections have biases; the output projection has none;
* with ``use_sliding_window``, the layers from ``max_window_layers`` on attend only to
  the last ``sliding_window`` tokens, the layers below it to the whole sequence.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import AttentionConfig, DefaultRotaryConfig, RotaryConfig
from levanter_core.models.decoder import DecoderConfig, DecoderLM, LayerType

# Hugging Face's class defaults, for config.json files that leave these keys out
_HF_SLIDING_WINDOW = 4096
_HF_MAX_WINDOW_LAYERS = 28


class QwenConfig(DecoderConfig):
    """The ``model:`` section for ``type: qwen``. Defaults are Qwen2.5-7B's."""

    type: str = "qwen"

    hf_architecture = "Qwen2ForCausalLM"
    hf_model_type = "qwen2"
    hf_keys: ClassVar = {
        **DecoderConfig.hf_keys,
        # Qwen2Config has no head_dim key, but its attention honours one if present
        "head_dim": dataclasses.replace(DecoderConfig.hf_keys["head_dim"], written=False),
        "use_sliding_window": HfKey("use_sliding_window", False),
        # Hugging Face itself writes null when the window is off
        "sliding_window": HfKey(
            "sliding_window", _HF_SLIDING_WINDOW, write=lambda v, c: v if c.use_sliding_window else None
        ),
        "max_window_layers": HfKey("max_window_layers", _HF_MAX_WINDOW_LAYERS),
    }
    # dropout acts only in training, and we train without it: refuse it rather than drop it
    hf_refused: ClassVar = {"attention_dropout": (0, 0.0)}

    seq_len: PositiveInt = 4096
    hidden_dim: PositiveInt = 3584
    intermediate_dim: PositiveInt = 18944
    num_layers: PositiveInt = 28
    num_heads: PositiveInt = 28
    num_kv_heads: PositiveInt = 4
    layer_norm_epsilon: float = Field(1e-6, gt=0.0)
    rope: RotaryConfig = DefaultRotaryConfig(theta=1_000_000.0)

    use_sliding_window: bool = False
    """Let the layers from ``max_window_layers`` on attend over a sliding window."""

    sliding_window: PositiveInt | None = _HF_SLIDING_WINDOW
    """With ``use_sliding_window``, each token of a sliding layer attends to itself and the
    ``sliding_window - 1`` tokens before it."""

    max_window_layers: NonNegativeInt = 28
    """With ``use_sliding_window``, layers ``0 .. max_window_layers - 1`` attend to the
    whole sequence and the layers after them over the sliding window."""

    @model_validator(mode="after")
    def _check_window(self):
        if self.use_sliding_window and self.sliding_window is None:
            raise ValueError("use_sliding_window is true but sliding_window is null; give the window's size")
        return self

    def attention_types(self) -> tuple[LayerType, ...]:
        slides = [self.use_sliding_window and i >= self.max_window_layers for i in range(self.num_layers)]
        return tuple("sliding_attention" if s else "full_attention" for s in slides)

    def sliding_layers(self) -> tuple[bool, ...]:
        """For each layer, whether it attends over the sliding window."""
        return tuple(t == "sliding_attention" for t in self.attention_types())

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(super().attention_config(), qkv_bias=True)

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> QwenConfig:
        config = super().from_hf_config(hf_config)
        # Hugging Face lets layer_types name any pattern; we support the one that
        # use_sliding_window and max_window_layers describe, which is what Qwen ships.
        layer_types = hf_config.get("layer_types")
        if layer_types is not None and tuple(layer_types) != config.attention_types():
            raise ValueError(
                f"layer_types {layer_types} is not supported: a {cls.hf_model_type} model slides the layers from "
                f"max_window_layers ({config.max_window_layers}) on when use_sliding_window is true "
                f"({config.use_sliding_window} here), which gives {list(config.attention_types())}"
            )
        return config

    def hf_layer_types(self) -> list[str]:
        """Hugging Face's ``layer_types``: each layer's attention, full or sliding."""
        return list(self.attention_types())

    def to_hf_config(self, vocab_size: int) -> dict:
        hf = {**super().to_hf_config(vocab_size), "layer_types": self.hf_layer_types()}
        if self.head_dim is not None:
            hf["head_dim"] = self.head_dim
        return hf


QwenLMHeadModel = DecoderLM
"""A Qwen model is the kit's :class:`~levanter_core.models.decoder.DecoderLM` (the name is kept)."""
