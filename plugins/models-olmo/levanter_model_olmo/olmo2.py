"""OLMo 2 (OLMo et al., 2024, "2 OLMo 2 Furious"): the kit's decoder with its norms *after*
the sublayers instead of before them.

Each layer adds ``post_attention_layernorm(attn(x))`` and then
``post_feedforward_layernorm(mlp(x))`` to the residual stream, and nothing normalizes the
sublayers' inputs. To keep attention logits bounded without pre-norms, queries and keys
are RMS-normalized over the whole projection (all heads together) before the rotary
embedding.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pydantic import Field, PositiveInt

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import AttentionConfig, DefaultRotaryConfig, RotaryConfig
from levanter_core.models.decoder import DecoderConfig, DecoderLM


class Olmo2Config(DecoderConfig):
    """The ``model:`` section for ``type: olmo2``. Defaults are OLMo 2 7B's (``OLMo-2-1124-7B``)."""

    type: str = "olmo2"
    default_hf_checkpoint = "allenai/OLMo-2-1124-7B"

    hf_architecture = "Olmo2ForCausalLM"
    hf_model_type = "olmo2"
    hf_keys: ClassVar = {
        **DecoderConfig.hf_keys,
        # not a field of Hugging Face's Olmo2Config: written by to_hf_config only when not implied
        "head_dim": dataclasses.replace(DecoderConfig.hf_keys["head_dim"], written=False),
        "layer_norm_epsilon": HfKey("rms_norm_eps", 1e-5),
        "use_bias": HfKey("attention_bias", False),
    }
    # dropout acts only in training, and we train without it: refuse it rather than drop it
    hf_refused: ClassVar = {"attention_dropout": (0, 0.0)}
    norm_placement = "post"

    seq_len: PositiveInt = 4096
    layer_norm_epsilon: float = Field(1e-6, gt=0.0)

    use_bias: bool = False
    """Biases on the attention projections, ``o_proj`` included (``attention_bias``)."""

    rope: RotaryConfig = DefaultRotaryConfig(theta=500000.0)
    """Rotary embedding and its scaling: ``{type: default|linear|llama3|yarn|longrope|dynamic,
    theta: ...}``. OLMo 2 uses ``theta: 500000``; a ``rope:`` section that omits ``theta`` gets
    the scaling's own default."""

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(
            super().attention_config(),
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            # one norm over every query head together (and one over every key head), as
            # OLMo 2 computes it before splitting the projection into heads
            qk_norm="all_heads",
            qk_norm_eps=self.layer_norm_epsilon,
        )

    def to_hf_config(self, vocab_size: int) -> dict:
        hf = super().to_hf_config(vocab_size)
        if self.head_dim is not None and self.head_dim != self.hidden_dim // self.num_heads:
            hf["head_dim"] = self.head_dim
        return hf


Olmo2LMHeadModel = DecoderLM
"""An OLMo 2 model is the kit's :class:`~levanter_core.models.decoder.DecoderLM` (the name is kept)."""
