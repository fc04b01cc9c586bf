"""Llama 1, 2 and 3 (Touvron et al., 2023; Meta, 2024) over Haliax named axes.

A pre-norm decoder: RMSNorm, grouped-query attention with rotary embeddings, RMSNorm,
SwiGLU MLP, each added to the residual stream; a final RMSNorm and an output projection
that may be tied to the token embeddings. Llama 3.1's long-context scaling is
``rope: {type: llama3}``.

Module fields carry Hugging Face's parameter names (``model.layers.0.self_attn.q_proj``),
so import and export are name-for-name copies (see ``levanter_core.hf``).
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
from haliax import Axis, NamedArray
from pydantic import Field, PositiveInt, model_validator

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


class LlamaConfig(LmConfig, HfConvertible):
    """The ``model:`` section for ``type: llama``."""

    type: str = "llama"
    """The registered type name."""
    default_hf_checkpoint: ClassVar[str | None] = "NousResearch/Llama-2-7b-hf"
    """What ``initialize_from_hf: true`` loads without ``reference_checkpoint`` (Levanter's default)."""

    hf_architecture: ClassVar[str] = "LlamaForCausalLM"
    hf_model_type: ClassVar[str] = "llama"

    seq_len: PositiveInt = 2048
    """Length of the training sequences (Hugging Face's ``max_position_embeddings``)."""

    hidden_dim: PositiveInt = 4096
    """Width of the residual stream (``hidden_size``)."""

    intermediate_dim: PositiveInt = 11008
    """Width of the MLP's hidden layer (``intermediate_size``)."""

    num_layers: PositiveInt = 32
    """Number of decoder layers."""

    num_heads: PositiveInt = 32
    """Number of query heads."""

    num_kv_heads: PositiveInt = 32
    """Number of key/value heads: ``num_heads`` for multi-head attention, 1 for multi-query,
    anything dividing ``num_heads`` for grouped-query attention."""

    head_dim: PositiveInt | None = None
    """Size of each head; ``None`` means ``hidden_dim // num_heads``."""

    activation_function: ActivationName = "silu"
    """Nonlinearity of the gated MLP (``hidden_act``)."""

    initializer_range: float = Field(0.02, gt=0.0)
    """Standard deviation of the normal initialization of every weight matrix and embedding."""

    layer_norm_epsilon: float = Field(1e-5, gt=0.0)
    """Epsilon of every RMSNorm (``rms_norm_eps``)."""

    use_layer_norm_weight: bool = True
    """Whether the RMSNorms have a learned scale. False: plain normalization, no parameter
    (as in Levanter's OLMo-style ablations); such a model has no Hugging Face counterpart."""

    upcast_attn: bool = False
    """Compute the query-key products in float32 even when the compute precision is lower
    (the softmax always runs in float32)."""

    tie_word_embeddings: bool = False
    """Use the token embedding matrix as the output projection."""

    use_bias: bool = False
    """Biases on the attention projections (``attention_bias``)."""

    rope: RotaryConfig = DefaultRotaryConfig()
    """Rotary embedding and its scaling: ``{type: default|linear|llama3|yarn, theta: ...}``."""

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
    def _check_heads(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden_dim % self.num_heads:
            raise ValueError(
                f"hidden_dim ({self.hidden_dim}) must be divisible by num_heads ({self.num_heads}) unless head_dim is set"
            )
        return self

    # -- axes -----------------------------------------------------------------------------
    @property
    def actual_head_dim(self) -> int:
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

    def attention_config(self) -> AttentionConfig:
        """The attention layer's settings; subclasses (Mistral) add a sliding window."""
        return AttentionConfig(
            Embed=self.Embed,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.actual_head_dim,
            rope=self.rope,
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            backend=self.attn_backend,
            query_block=self.flash_attention_block_size,
            upcast=self.upcast_attn,
            initializer_range=self.initializer_range,
        )

    # -- the core's interface -----------------------------------------------------------------
    def build(self, Vocab: Axis, *, key) -> "LlamaLMHeadModel":
        return LlamaLMHeadModel.init(Vocab, self, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
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

    # -- Hugging Face -------------------------------------------------------------------------
    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        """Our fields from a Hugging Face config; Mistral and Qwen extend this."""
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias: true is not supported")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim")
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
            use_bias=hf.get("attention_bias", False),
            rope=rotary_from_hf(
                hf.get("rope_parameters") or hf.get("rope_scaling"), default_theta=hf.get("rope_theta", 10000.0), hf_config=hf
            ),
        )

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "LlamaConfig":
        return cls(**cls.hf_fields(hf_config))

    def to_hf_config(self, vocab_size: int) -> dict:
        return {
            "model_type": self.hf_model_type,
            "vocab_size": vocab_size,
            "max_position_embeddings": self.seq_len,
            "hidden_size": self.hidden_dim,
            "intermediate_size": self.intermediate_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.actual_head_dim,
            "hidden_act": self.activation_function,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.layer_norm_epsilon,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.use_bias,
            "mlp_bias": False,
            "rope_parameters": self.rope.to_hf(),
        }

    def hf_ignored_tensors(self) -> frozenset[str]:
        # a tied checkpoint may still carry a copy of the embeddings as the head
        return frozenset({"lm_head.weight"}) if self.tie_word_embeddings else frozenset()


class LlamaDecoderLayer(eqx.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    self_attn: Attention
    mlp: GatedMlp
    input_layernorm: RmsNorm
    post_attention_layernorm: RmsNorm

    @staticmethod
    def init(config: LlamaConfig, *, key) -> "LlamaDecoderLayer":
        k_attn, k_mlp = jax.random.split(key, 2)
        return LlamaDecoderLayer(
            Attention.init(config.attention_config(), key=k_attn),
            GatedMlp.init(config.Embed, config.Mlp, config.activation_function, key=k_mlp, std=config.initializer_range),
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_weight=config.use_layer_norm_weight),
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_weight=config.use_layer_norm_weight),
        )

    def __call__(self, x: NamedArray, mask: AttentionMask, sliding=None) -> NamedArray:
        x = x + self.self_attn(self.input_layernorm(x), mask, sliding=sliding)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(eqx.Module):
    """Token embeddings, the decoder layers, and the final norm (Hugging Face's ``model.``)."""

    config: LlamaConfig = eqx.field(static=True)
    embed_tokens: hnn.Embedding
    layers: hnn.Stacked  # of LlamaDecoderLayer (hnn.BlockSeq when scan_layers is false)
    norm: RmsNorm

    @staticmethod
    def init(Vocab: Axis, config: LlamaConfig, *, key, layer_cls=LlamaDecoderLayer) -> "LlamaModel":
        k_embed, k_layers = jax.random.split(key, 2)
        embed = hax.random.normal(k_embed, (Vocab, config.Embed)) * config.initializer_range
        stack = hnn.Stacked if config.scan_layers else hnn.BlockSeq
        layers = stack.init(config.Layers, layer_cls, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jax.random.split(k_layers, config.num_layers)
        )
        return LlamaModel(
            config,
            hnn.Embedding(embed, Vocab=Vocab, Embed=config.Embed),
            layers,
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_weight=config.use_layer_norm_weight),
        )

    def __call__(self, input_ids: NamedArray, mask: AttentionMask, sliding=None) -> NamedArray:
        x = self.embed_tokens.embed(input_ids)
        x = self.layers.fold(x, mask, sliding, unroll=self.config.unroll_layers)
        return self.norm(x)


class LlamaLMHeadModel(eqx.Module):
    """Llama with its output projection (``lm_head``, absent when tied to the embeddings).

    Follows :class:`levanter_core.models.lm.LmHeadModel`."""

    model: LlamaModel
    lm_head: hnn.Linear | None

    @staticmethod
    def init(Vocab: Axis, config: LlamaConfig, *, key) -> "LlamaLMHeadModel":
        k_model, k_head = jax.random.split(key, 2)
        head = None
        if not config.tie_word_embeddings:
            head = init_linear(config.Embed, Vocab, key=k_head, std=config.initializer_range)
        return LlamaLMHeadModel(LlamaModel.init(Vocab, config, key=k_model), head)

    @property
    def config(self) -> LlamaConfig:
        return self.model.config

    @property
    def Vocab(self) -> Axis:
        return self.model.embed_tokens.Vocab

    def activations(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        return self.model(input_ids, attn_mask or AttentionMask.causal_mask())

    def get_lm_head(self) -> NamedArray:
        if self.lm_head is None:
            return self.model.embed_tokens.weight.rearrange((self.config.Embed.name, self.Vocab.name))
        return self.lm_head.weight.rearrange((self.config.Embed.name, self.Vocab.name))

    def __call__(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        hidden = self.activations(input_ids, key=key, attn_mask=attn_mask)
        return hax.dot(hidden, self.get_lm_head(), axis=self.config.Embed.name)
