"""Building blocks that architecture plugins compose: attention and its masks, rotary
embeddings, normalization, feed-forward and mixture-of-experts layers, and stacks of layers.
The decoder they make up is :mod:`levanter_core.models.decoder`."""

from levanter_core.layers.attention import (
    Attention,
    AttentionBackend,
    AttentionConfig,
    AttentionMask,
    dot_product_attention,
)
from levanter_core.layers.mlp import ACTIVATIONS, ActivationName, GatedMlp, Mlp, init_linear
from levanter_core.layers.moe import (
    FUSED_INTERLEAVED_EXPERTS,
    MIXTRAL_EXPERTS,
    SPLIT_EXPERTS,
    ExpertLayout,
    Experts,
    MoeBlock,
    MoeConfig,
    RouterStats,
    router_losses,
)
from levanter_core.layers.norm import LayerNorm, RmsNorm
from levanter_core.layers.pipeline import fold_layers, scan_layers
from levanter_core.layers.rotary import (
    DefaultRotaryConfig,
    DynamicRotaryConfig,
    LinearRotaryConfig,
    Llama3RotaryConfig,
    LongRopeConfig,
    RotaryConfig,
    YarnRotaryConfig,
    apply_rotary,
    rotary_from_hf,
    rotary_tables,
)
from levanter_core.layers.stack import LayerGroups, stack_layers

__all__ = [
    "ACTIVATIONS",
    "FUSED_INTERLEAVED_EXPERTS",
    "MIXTRAL_EXPERTS",
    "SPLIT_EXPERTS",
    "ActivationName",
    "Attention",
    "AttentionBackend",
    "AttentionConfig",
    "AttentionMask",
    "DefaultRotaryConfig",
    "DynamicRotaryConfig",
    "ExpertLayout",
    "Experts",
    "GatedMlp",
    "LayerGroups",
    "LayerNorm",
    "LinearRotaryConfig",
    "Llama3RotaryConfig",
    "LongRopeConfig",
    "Mlp",
    "MoeBlock",
    "MoeConfig",
    "RmsNorm",
    "RotaryConfig",
    "RouterStats",
    "YarnRotaryConfig",
    "apply_rotary",
    "dot_product_attention",
    "fold_layers",
    "init_linear",
    "rotary_from_hf",
    "rotary_tables",
    "router_losses",
    "scan_layers",
    "stack_layers",
]
