"""Qwen 2 and Qwen 2.5 (Qwen team, 2024) over Haliax named axes.

Llama's pre-norm decoder (RMSNorm, grouped-query attention with rotary embeddings,
RMSNorm, SwiGLU MLP, each added to the residual stream) with two differences:

* the query, key and value projections have biases; the output projection has none;
* with ``use_sliding_window``, the layers from ``max_window_layers`` on attend only to
  the last ``sliding_window`` tokens, the layers below it to the whole sequence.

Every block comes from :mod:`levanter_core.layers`; this file only chooses their
settings and wires them together. Module fields carry Hugging Face's parameter names
(``model.layers.0.self_attn.q_proj``), so import and export are name-for-name copies
(see :mod:`levanter_core.hf`).
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from levanter_core.hf import HfConvertible
from levanter_core.layers import (
    ActivationName,
    Attention,
    AttentionBackend,
    AttentionConfig,
    AttentionMask,
    DefaultRotaryConfig,
    GatedMlp,
    RmsNorm,
    RotaryConfig,
    init_linear,
    rotary_from_hf,
)
from levanter_core.models.flops import lm_flops_per_token
from levanter_core.models.lm import GradientCheckpointing, LmConfig

# Hugging Face's class defaults, for config.json files that leave these keys out
_HF_SLIDING_WINDOW = 4096
_HF_MAX_WINDOW_LAYERS = 28


class QwenConfig(LmConfig, HfConvertible):
    """The ``model:`` section for ``type: qwen``. Defaults are Qwen2.5-7B's."""

    type: str = "qwen"
    """The registered type name."""

    hf_architecture: ClassVar[str] = "Qwen2ForCausalLM"
    hf_model_type: ClassVar[str] = "qwen2"
    """The ``model_type`` written into ``config.json``."""

    seq_len: PositiveInt = 4096
    """Length of the training sequences (Hugging Face's ``max_position_embeddings``). Qwen
    pretrains at 4,096 tokens before extending to longer contexts."""

    hidden_dim: PositiveInt = 3584
    """Width of the residual stream (``hidden_size``)."""

    intermediate_dim: PositiveInt = 18944
    """Width of the MLP's hidden layer (``intermediate_size``)."""

    num_layers: PositiveInt = 28
    """Number of decoder layers (``num_hidden_layers``)."""

    num_heads: PositiveInt = 28
    """Number of query heads (``num_attention_heads``)."""

    num_kv_heads: PositiveInt = 4
    """Number of key/value heads (``num_key_value_heads``): ``num_heads`` for multi-head
    attention, 1 for multi-query, anything dividing ``num_heads`` for grouped-query."""

    head_dim: PositiveInt | None = None
    """Size of each head; ``None`` means ``hidden_dim // num_heads``."""

    activation_function: ActivationName = "silu"
    """Nonlinearity of the gated MLP (``hidden_act``)."""

    initializer_range: float = Field(0.02, gt=0.0)
    """Standard deviation of the normal initialization of every weight matrix and embedding."""

    layer_norm_epsilon: float = Field(1e-6, gt=0.0)
    """Epsilon of every RMSNorm (``rms_norm_eps``)."""

    tie_word_embeddings: bool = False
    """Use the token embedding matrix as the output projection (Qwen's smallest models do)."""

    rope: RotaryConfig = DefaultRotaryConfig(theta=1_000_000.0)
    """Rotary embedding and its scaling: ``{type: default|linear|llama3|yarn, theta: ...}``;
    Qwen's base wavelength is ``theta: 1000000``."""

    use_sliding_window: bool = False
    """Let the layers from ``max_window_layers`` on attend over a sliding window."""

    sliding_window: PositiveInt | None = _HF_SLIDING_WINDOW
    """With ``use_sliding_window``, each token of a sliding layer attends to itself and the
    ``sliding_window - 1`` tokens before it."""

    max_window_layers: NonNegativeInt = 28
    """With ``use_sliding_window``, layers ``0 .. max_window_layers - 1`` attend to the
    whole sequence and the layers after them over the sliding window."""

    attn_backend: AttentionBackend = "auto"
    """Attention implementation: ``reference`` (plain einsums), ``jax``
    (``jax.nn.dot_product_attention``, cuDNN flash attention on GPU), or ``auto``
    (``jax`` on GPU, ``reference`` elsewhere)."""

    gradient_checkpointing: GradientCheckpointing = True
    """Recompute each layer's activations in the backward pass instead of storing them (``true``),
    store them all (``false``), or one of Levanter's policies: ``offload``, ``recompute``,
    ``save_all``, ``nested`` (see ``levanter_core.models.lm.GradientCheckpointing``)."""

    scan_layers: bool = True
    """Run the layers as one ``jax.lax.scan`` (fast compilation) rather than unrolled."""

    @model_validator(mode="after")
    def _check_shapes(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden_dim % self.num_heads:
            raise ValueError(
                f"hidden_dim ({self.hidden_dim}) must be divisible by num_heads ({self.num_heads}) unless head_dim is set"
            )
        if self.use_sliding_window and self.sliding_window is None:
            raise ValueError("use_sliding_window is true but sliding_window is null; give the window's size")
        return self

    # -- axes and derived settings ----------------------------------------------------------
    @property
    def actual_head_dim(self) -> int:
        """``head_dim``, or ``hidden_dim // num_heads`` when it is unset."""
        return self.head_dim or self.hidden_dim // self.num_heads

    @property
    def Embed(self) -> Axis:
        return Axis("embed", self.hidden_dim)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.intermediate_dim)

    @property
    def Layers(self) -> Axis:
        return Axis("layers", self.num_layers)

    def sliding_layers(self) -> tuple[bool, ...]:
        """For each layer, whether it attends over the sliding window."""
        return tuple(self.use_sliding_window and i >= self.max_window_layers for i in range(self.num_layers))

    def attention_config(self) -> AttentionConfig:
        """The attention layer's settings (Qwen 3 changes a few)."""
        return AttentionConfig(
            Embed=self.Embed,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.actual_head_dim,
            rope=self.rope,
            qkv_bias=True,
            out_bias=False,
            sliding_window=self.sliding_window if any(self.sliding_layers()) else None,
            backend=self.attn_backend,
            query_block=self.flash_attention_block_size,
            initializer_range=self.initializer_range,
        )

    # -- the core's interface ---------------------------------------------------------------
    def build(self, Vocab: Axis, *, key) -> "QwenLMHeadModel":
        return QwenLMHeadModel.init(Vocab, self, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
        # counts full attention in every layer, as if no window were set (an upper bound)
        return lm_flops_per_token(
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.intermediate_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.actual_head_dim,
            seq_len=self.seq_len,
            vocab_size=vocab_size,
        )

    # -- Hugging Face -----------------------------------------------------------------------
    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        """Our fields from a Hugging Face ``config.json``; Qwen 3 adds its own."""
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim")  # Qwen2 has no such key, but honours one if present
        # transformers 5 writes rope_parameters; older files have rope_theta and rope_scaling
        rope = rotary_from_hf(
            hf.get("rope_parameters") or hf.get("rope_scaling"), default_theta=hf.get("rope_theta", 1e4), hf_config=hf
        )
        return dict(
            seq_len=hf["max_position_embeddings"],
            hidden_dim=hf["hidden_size"],
            intermediate_dim=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=None if head_dim in (None, hf["hidden_size"] // num_heads) else head_dim,
            activation_function=hf.get("hidden_act", "silu"),
            initializer_range=hf.get("initializer_range", 0.02),
            layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            rope=rope,
            use_sliding_window=hf.get("use_sliding_window", False),
            sliding_window=hf.get("sliding_window", _HF_SLIDING_WINDOW),
            max_window_layers=hf.get("max_window_layers", _HF_MAX_WINDOW_LAYERS),
        )

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "QwenConfig":
        config = cls(**cls.hf_fields(hf_config))
        # Hugging Face lets layer_types name any pattern; we support the one that
        # use_sliding_window and max_window_layers describe, which is what Qwen ships.
        layer_types = hf_config.get("layer_types")
        if layer_types is not None and list(layer_types) != config.hf_layer_types():
            raise ValueError(
                f"layer_types {layer_types} is not supported: a {cls.hf_model_type} model slides the layers from "
                f"max_window_layers ({config.max_window_layers}) on when use_sliding_window is true "
                f"({config.use_sliding_window} here), which gives {config.hf_layer_types()}"
            )
        return config

    def hf_layer_types(self) -> list[str]:
        """Hugging Face's ``layer_types``: each layer's attention, full or sliding."""
        return ["sliding_attention" if s else "full_attention" for s in self.sliding_layers()]

    def to_hf_config(self, vocab_size: int) -> dict:
        hf = {
            "model_type": self.hf_model_type,
            "vocab_size": vocab_size,
            "max_position_embeddings": self.seq_len,
            "hidden_size": self.hidden_dim,
            "intermediate_size": self.intermediate_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "hidden_act": self.activation_function,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.layer_norm_epsilon,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": self.rope.to_hf(),
            "use_sliding_window": self.use_sliding_window,
            # Hugging Face itself writes null when the window is off
            "sliding_window": self.sliding_window if self.use_sliding_window else None,
            "max_window_layers": self.max_window_layers,
            "layer_types": self.hf_layer_types(),
        }
        if self.head_dim is not None:
            hf["head_dim"] = self.head_dim
        return hf

    def hf_ignored_tensors(self) -> frozenset[str]:
        # a tied checkpoint may still carry a copy of the embeddings as the head
        return frozenset({"lm_head.weight"}) if self.tie_word_embeddings else frozenset()


class QwenDecoderLayer(eqx.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    self_attn: Attention
    mlp: GatedMlp
    input_layernorm: RmsNorm
    post_attention_layernorm: RmsNorm

    @staticmethod
    def init(config: QwenConfig, *, key) -> "QwenDecoderLayer":
        k_attn, k_mlp = jax.random.split(key, 2)
        return QwenDecoderLayer(
            Attention.init(config.attention_config(), key=k_attn),
            GatedMlp.init(config.Embed, config.Mlp, config.activation_function, key=k_mlp, std=config.initializer_range),
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon),
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon),
        )

    def __call__(self, x: NamedArray, mask: AttentionMask, sliding: NamedArray | None = None) -> NamedArray:
        x = x + self.self_attn(self.input_layernorm(x), mask, sliding=sliding)
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenModel(eqx.Module):
    """Token embeddings, the decoder layers, and the final norm (Hugging Face's ``model.``)."""

    config: QwenConfig = eqx.field(static=True)
    embed_tokens: hnn.Embedding
    layers: hnn.Stacked  # of QwenDecoderLayer (hnn.BlockSeq when scan_layers is false)
    norm: RmsNorm

    @staticmethod
    def init(Vocab: Axis, config: QwenConfig, *, key) -> "QwenModel":
        k_embed, k_layers = jax.random.split(key, 2)
        embed = hax.random.normal(k_embed, (Vocab, config.Embed)) * config.initializer_range
        stack = hnn.Stacked if config.scan_layers else hnn.BlockSeq
        layers = stack.init(config.Layers, QwenDecoderLayer, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jax.random.split(k_layers, config.num_layers)
        )
        return QwenModel(
            config,
            hnn.Embedding(embed, Vocab=Vocab, Embed=config.Embed),
            layers,
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon),
        )

    def sliding_flags(self) -> NamedArray | None:
        """Each layer's sliding-window switch, along the ``layers`` axis so that the fold
        hands every layer its own. None when all layers are alike: the window (if any)
        is then fixed, which lets the ``jax`` backend use cuDNN's windowed kernel."""
        flags = self.config.sliding_layers()
        if len(set(flags)) == 1:
            return None
        return hax.named(jnp.array(flags), self.config.Layers)

    def __call__(self, input_ids: NamedArray, mask: AttentionMask) -> NamedArray:
        x = self.embed_tokens.embed(input_ids)
        x = self.layers.fold(x, mask, self.sliding_flags(), unroll=self.config.unroll_layers)
        return self.norm(x)


class QwenLMHeadModel(eqx.Module):
    """Qwen with its output projection (``lm_head``, absent when tied to the embeddings).

    Follows :class:`levanter_core.models.lm.LmHeadModel`. Qwen 3 builds the same modules
    with its own config."""

    model: QwenModel
    lm_head: hnn.Linear | None

    @staticmethod
    def init(Vocab: Axis, config: QwenConfig, *, key) -> "QwenLMHeadModel":
        k_model, k_head = jax.random.split(key, 2)
        head = None
        if not config.tie_word_embeddings:
            head = init_linear(config.Embed, Vocab, key=k_head, std=config.initializer_range)
        return QwenLMHeadModel(QwenModel.init(Vocab, config, key=k_model), head)

    @property
    def config(self) -> QwenConfig:
        return self.model.config

    @property
    def Vocab(self) -> Axis:
        return self.model.embed_tokens.Vocab

    def activations(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        """Final hidden states. ``attn_mask`` (default causal) can add document segments."""
        return self.model(input_ids, attn_mask if attn_mask is not None else AttentionMask.causal_mask())

    def get_lm_head(self) -> NamedArray:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return weight.rearrange((self.config.Embed.name, self.Vocab.name))

    def __call__(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        hidden = self.activations(input_ids, key=key, attn_mask=attn_mask)
        return hax.dot(hidden, self.get_lm_head(), axis=self.config.Embed.name)
