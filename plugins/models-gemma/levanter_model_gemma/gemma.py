"""Gemma (Gemma Team, 2024) over Haliax named axes.

Gemma is a pre-norm decoder much like Llama, with four differences that matter for
exact results:

* the token embeddings are multiplied by ``sqrt(hidden_dim)`` on the way in (rounded
  to the compute dtype first, as Hugging Face does), while the tied output projection
  uses the unscaled matrix;
* every RMSNorm scales by ``1 + weight``, and checkpoints store ``weight`` (zero at
  initialization);
* the gated MLP uses the tanh approximation of GELU (GeGLU);
* ``head_dim`` is set independently of ``hidden_dim / num_heads``, and the smaller
  models use multi-query attention (one key/value head).

The embedding, the final norm and the output head (:class:`GemmaModel`,
:class:`GemmaLMHeadModel`) are shared with Gemma 2 and 3, which change only the
decoder layer and the attention settings. Module fields carry Hugging Face's parameter
names, so import and export are name-for-name copies (see ``levanter_core.hf``).
"""

from __future__ import annotations

import math
from typing import ClassVar

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
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
from levanter_core.models.lm import GradientCheckpointing, LmConfig, soft_cap

GEMMA_NORM_OFFSET = 1.0
"""Gemma's RMSNorms scale by ``1 + weight``."""


class GemmaConfig(LmConfig, HfConvertible):
    """The ``model:`` section for ``type: gemma``. Defaults are Gemma 2B's."""

    type: str = "gemma"
    """The registered type name."""
    default_hf_checkpoint: ClassVar[str | None] = "google/gemma-2b"
    """What ``initialize_from_hf: true`` loads without ``reference_checkpoint`` (Levanter's default)."""

    hf_architecture: ClassVar[str] = "GemmaForCausalLM"
    hf_model_type: ClassVar[str] = "gemma"

    seq_len: PositiveInt = 8192
    """Length of the training sequences (Hugging Face's ``max_position_embeddings``)."""

    hidden_dim: PositiveInt = 2048
    """Width of the residual stream (``hidden_size``)."""

    intermediate_dim: PositiveInt = 16384
    """Width of the MLP's hidden layer (``intermediate_size``)."""

    num_layers: PositiveInt = 18
    """Number of decoder layers."""

    num_heads: PositiveInt = 8
    """Number of query heads."""

    num_kv_heads: PositiveInt = 1
    """Number of key/value heads: 1 for multi-query attention (Gemma 2B), ``num_heads`` for
    multi-head attention (Gemma 7B), anything dividing ``num_heads`` for grouped-query."""

    head_dim: PositiveInt = 256
    """Size of each attention head; independent of ``hidden_dim / num_heads``."""

    activation_function: ActivationName = "gelu_pytorch_tanh"
    """Nonlinearity of the gated MLP (the tanh approximation of GELU)."""

    initializer_range: float = Field(0.02, gt=0.0)
    """Standard deviation of the normal initialization of every weight matrix and embedding."""

    layer_norm_epsilon: float = Field(1e-6, gt=0.0)
    """Epsilon of every RMSNorm (``rms_norm_eps``)."""

    tie_word_embeddings: bool = True
    """Use the token embedding matrix (unscaled) as the output projection."""

    use_bias: bool = False
    """Biases on the attention projections (``attention_bias``)."""

    rope: RotaryConfig = DefaultRotaryConfig()
    """Rotary embedding and its scaling: ``{type: default|linear|llama3|yarn, theta: ...}``."""

    attn_backend: AttentionBackend = "auto"
    """Attention implementation: ``reference`` (plain einsums), ``jax``
    (``jax.nn.dot_product_attention``, cuDNN flash attention on GPU), or ``auto``
    (``jax`` on GPU, ``reference`` elsewhere or when attention logits are soft-capped)."""

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
        return self

    # -- axes -----------------------------------------------------------------------------
    @property
    def Embed(self) -> Axis:
        return Axis("embed", self.hidden_dim)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.intermediate_dim)

    @property
    def Layers(self) -> Axis:
        return Axis("layers", self.num_layers)

    # -- what Gemma 2 and 3 change ----------------------------------------------------------------
    def attention_config(self) -> AttentionConfig:
        """The attention layer's settings; Gemma 2 and 3 add scaling, soft-capping and windows."""
        return AttentionConfig(
            Embed=self.Embed,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope=self.rope,
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            backend=self.attn_backend,
            query_block=self.flash_attention_block_size,
            initializer_range=self.initializer_range,
        )

    def sliding_layers(self) -> NamedArray | None:
        """Per-layer booleans (axis ``layers``) saying which layers attend through a sliding
        window; None when no layer does (Gemma 1)."""
        return None

    @property
    def final_logit_soft_cap(self) -> float | None:
        """Soft cap of the output logits (Gemma 2); the core's loss applies it too."""
        return None

    # -- the core's interface -----------------------------------------------------------------
    def build(self, Vocab: Axis, *, key) -> "GemmaLMHeadModel":
        return GemmaLMHeadModel.init(Vocab, self, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
        return lm_flops_per_token(
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.intermediate_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            seq_len=self.seq_len,
            vocab_size=vocab_size,
        )

    # -- Hugging Face -------------------------------------------------------------------------
    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        """Our fields from a Hugging Face config; Gemma 2 and 3 extend this."""
        if hf.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention: true (embedding models) is not supported; only causal LMs")
        num_heads = hf["num_attention_heads"]
        # The original Gemma 1 configs say "gelu" but the models were trained with the tanh
        # approximation; transformers makes the same substitution.
        activation = hf.get("hidden_act") or "gelu_pytorch_tanh"
        return dict(
            seq_len=hf["max_position_embeddings"],
            hidden_dim=hf["hidden_size"],
            intermediate_dim=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or 256,
            activation_function="gelu_pytorch_tanh" if activation == "gelu" else activation,
            initializer_range=hf.get("initializer_range", 0.02),
            layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
            use_bias=hf.get("attention_bias", False),
            rope=rotary_from_hf(
                hf.get("rope_parameters") or hf.get("rope_scaling"), default_theta=hf.get("rope_theta", 10000.0), hf_config=hf
            ),
        )

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "GemmaConfig":
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
            "head_dim": self.head_dim,
            "hidden_act": self.activation_function,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.layer_norm_epsilon,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.use_bias,
            "rope_parameters": self.rope.to_hf(),
        }

    def hf_ignored_tensors(self) -> frozenset[str]:
        # a tied checkpoint may still carry a copy of the embeddings as the head
        return frozenset({"lm_head.weight"}) if self.tie_word_embeddings else frozenset()


def embedding_scale(hidden_dim: int, dtype) -> jax.Array:
    """The factor Gemma multiplies its input embeddings by: ``sqrt(hidden_dim)``, rounded to
    float32 and then to the compute dtype, as Hugging Face does (55.5, not 55.43, for
    hidden 3072 in bfloat16)."""
    return jnp.asarray(np.float32(math.sqrt(hidden_dim)), dtype=dtype)


def gemma_norm(config: GemmaConfig) -> RmsNorm:
    """An RMSNorm over ``embed`` scaling by ``1 + weight``."""
    return RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon, weight_offset=GEMMA_NORM_OFFSET)


def gemma_mlp(config: GemmaConfig, *, key) -> GatedMlp:
    """The gated MLP, ``down_proj(act(gate_proj(x)) * up_proj(x))``."""
    return GatedMlp.init(config.Embed, config.Mlp, config.activation_function, key=key, std=config.initializer_range)


class GemmaDecoderLayer(eqx.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    self_attn: Attention
    mlp: GatedMlp
    input_layernorm: RmsNorm
    post_attention_layernorm: RmsNorm

    @staticmethod
    def init(config: GemmaConfig, *, key) -> "GemmaDecoderLayer":
        k_attn, k_mlp = jax.random.split(key, 2)
        return GemmaDecoderLayer(
            Attention.init(config.attention_config(), key=k_attn),
            gemma_mlp(config, key=k_mlp),
            gemma_norm(config),
            gemma_norm(config),
        )

    def __call__(self, x: NamedArray, mask: AttentionMask, sliding=None) -> NamedArray:
        x = x + self.self_attn(self.input_layernorm(x), mask, sliding=sliding)
        return x + self.mlp(self.post_attention_layernorm(x))


class GemmaModel(eqx.Module):
    """Scaled token embeddings, the decoder layers, and the final norm (Hugging Face's ``model.``)."""

    config: GemmaConfig = eqx.field(static=True)
    embed_tokens: hnn.Embedding
    layers: hnn.Stacked  # of decoder layers (hnn.BlockSeq when scan_layers is false)
    norm: RmsNorm

    @staticmethod
    def init(Vocab: Axis, config: GemmaConfig, *, key, layer_cls=GemmaDecoderLayer) -> "GemmaModel":
        k_embed, k_layers = jax.random.split(key, 2)
        embed = hax.random.normal(k_embed, (Vocab, config.Embed)) * config.initializer_range
        stack = hnn.Stacked if config.scan_layers else hnn.BlockSeq
        layers = stack.init(config.Layers, layer_cls, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jax.random.split(k_layers, config.num_layers)
        )
        return GemmaModel(config, hnn.Embedding(embed, Vocab=Vocab, Embed=config.Embed), layers, gemma_norm(config))

    def __call__(self, input_ids: NamedArray, mask: AttentionMask) -> NamedArray:
        x = self.embed_tokens.embed(input_ids)
        x = x * embedding_scale(self.config.hidden_dim, x.dtype)
        x = self.layers.fold(x, mask, self.config.sliding_layers(), unroll=self.config.unroll_layers)
        return self.norm(x)


class GemmaLMHeadModel(eqx.Module):
    """A Gemma model with its output projection (``lm_head``, absent when tied to the
    embeddings, as in every released Gemma). Gemma 2 and 3 use this class with their own
    decoder layers.

    Follows :class:`levanter_core.models.lm.LmHeadModel`."""

    model: GemmaModel
    lm_head: hnn.Linear | None

    @staticmethod
    def init(Vocab: Axis, config: GemmaConfig, *, key, layer_cls=GemmaDecoderLayer) -> "GemmaLMHeadModel":
        k_model, k_head = jax.random.split(key, 2)
        head = None
        if not config.tie_word_embeddings:
            head = init_linear(config.Embed, Vocab, key=k_head, std=config.initializer_range)
        return GemmaLMHeadModel(GemmaModel.init(Vocab, config, key=k_model, layer_cls=layer_cls), head)

    @property
    def config(self) -> GemmaConfig:
        return self.model.config

    @property
    def Vocab(self) -> Axis:
        return self.model.embed_tokens.Vocab

    def activations(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        return self.model(input_ids, attn_mask or AttentionMask.causal_mask())

    def get_lm_head(self) -> NamedArray:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return weight.rearrange((self.config.Embed.name, self.Vocab.name))

    def __call__(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        hidden = self.activations(input_ids, key=key, attn_mask=attn_mask)
        logits = hax.dot(hidden, self.get_lm_head(), axis=self.config.Embed.name)
        return soft_cap(logits, self.config.final_logit_soft_cap)
