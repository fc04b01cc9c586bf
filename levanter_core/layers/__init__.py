"""Building blocks that architecture plugins compose: attention and its masks, rotary
embeddings, normalization and feed-forward layers."""

from levanter_core.layers.attention import Attention, AttentionBackend, AttentionConfig, AttentionMask, dot_product_attention
from levanter_core.layers.mlp import ACTIVATIONS, ActivationName, GatedMlp, init_linear
from levanter_core.layers.norm import LayerNorm, RmsNorm
from levanter_core.layers.rotary import (
    DefaultRotaryConfig,
    Llama3RotaryConfig,
    LinearRotaryConfig,
    RotaryConfig,
    YarnRotaryConfig,
    apply_rotary,
    rotary_from_hf,
    rotary_tables,
)

__all__ = [
    "ACTIVATIONS",
    "ActivationName",
    "Attention",
    "AttentionBackend",
    "AttentionConfig",
    "AttentionMask",
    "DefaultRotaryConfig",
    "GatedMlp",
    "LayerNorm",
    "LinearRotaryConfig",
    "Llama3RotaryConfig",
    "RmsNorm",
    "RotaryConfig",
    "YarnRotaryConfig",
    "apply_rotary",
    "dot_product_attention",
    "init_linear",
    "rotary_from_hf",
    "rotary_tables",
]
