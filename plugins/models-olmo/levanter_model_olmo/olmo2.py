"""OLMo 2 (OLMo et al., 2024, "2 OLMo 2 Furious") over Haliax named axes.

A Llama-like decoder whose norms sit *after* the sublayers instead of before them:
each layer adds ``post_attention_layernorm(attn(x))`` and then
``post_feedforward_layernorm(mlp(x))`` to the residual stream, and nothing normalizes
the sublayers' inputs. To keep attention logits bounded without pre-norms, queries
and keys are RMS-normalized over the whole projection (all heads together) before the
rotary embedding. A final RMSNorm precedes the output projection.

Module fields carry Hugging Face's parameter names (``model.layers.0.self_attn.q_norm``),
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


class Olmo2Config(LmConfig, HfConvertible):
    """The ``model:`` section for ``type: olmo2``. Defaults are OLMo 2 7B's (``OLMo-2-1124-7B``)."""

    type: str = "olmo2"
    """The registered type name."""
    default_hf_checkpoint: ClassVar[str | None] = "allenai/OLMo-2-1124-7B"
    """What ``initialize_from_hf: true`` loads without ``reference_checkpoint`` (Levanter's default)."""

    hf_architecture: ClassVar[str] = "Olmo2ForCausalLM"

    seq_len: PositiveInt = 4096
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
    """Number of key/value heads: ``num_heads`` for multi-head attention (OLMo 2 7B and
    13B), fewer for grouped-query attention (OLMo 2 32B uses 8)."""

    head_dim: PositiveInt | None = None
    """Size of each head; ``None`` means ``hidden_dim // num_heads``."""

    activation_function: ActivationName = "silu"
    """Nonlinearity of the gated MLP (``hidden_act``)."""

    initializer_range: float = Field(0.02, gt=0.0)
    """Standard deviation of the normal initialization of every weight matrix and embedding."""

    layer_norm_epsilon: float = Field(1e-6, gt=0.0)
    """Epsilon of every RMSNorm, the query and key norms included (``rms_norm_eps``)."""

    tie_word_embeddings: bool = False
    """Use the token embedding matrix as the output projection."""

    use_bias: bool = False
    """Biases on the attention projections, ``o_proj`` included (``attention_bias``)."""

    rope: RotaryConfig = DefaultRotaryConfig(theta=500000.0)
    """Rotary embedding and its scaling: ``{type: default|linear|llama3|yarn, theta: ...}``.
    OLMo 2 uses ``theta: 500000``; a ``rope:`` section that omits ``theta`` gets the
    scaling's own default."""

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
                f"hidden_dim ({self.hidden_dim}) must be divisible by num_heads ({self.num_heads}) "
                "unless head_dim is set"
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
        return AttentionConfig(
            Embed=self.Embed,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.actual_head_dim,
            rope=self.rope,
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            # one norm over every query head together (and one over every key head), as
            # OLMo 2 computes it before splitting the projection into heads
            qk_norm="all_heads",
            qk_norm_eps=self.layer_norm_epsilon,
            backend=self.attn_backend,
            query_block=self.flash_attention_block_size,
            initializer_range=self.initializer_range,
        )

    # -- the core's interface -----------------------------------------------------------------
    def build(self, Vocab: Axis, *, key) -> "Olmo2LMHeadModel":
        return Olmo2LMHeadModel.init(Vocab, self, key=key)

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
    def from_hf_config(cls, hf_config: dict) -> "Olmo2Config":
        hf = hf_config
        num_heads = hf["num_attention_heads"]
        # Olmo2Config has no head_dim field, but its attention honours one if present
        head_dim = hf.get("head_dim")
        return cls(
            seq_len=hf["max_position_embeddings"],
            hidden_dim=hf["hidden_size"],
            intermediate_dim=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=None if head_dim in (None, hf["hidden_size"] // num_heads) else head_dim,
            activation_function=hf.get("hidden_act", "silu"),
            initializer_range=hf.get("initializer_range", 0.02),
            layer_norm_epsilon=hf.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            use_bias=hf.get("attention_bias", False),
            # transformers 5 writes rope_parameters; older files have rope_theta + rope_scaling
            rope=rotary_from_hf(
                hf.get("rope_parameters") or hf.get("rope_scaling"), default_theta=hf.get("rope_theta", 10000.0), hf_config=hf
            ),
        )

    def to_hf_config(self, vocab_size: int) -> dict:
        config = {
            "model_type": "olmo2",
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
            "attention_bias": self.use_bias,
            "rope_parameters": self.rope.to_hf(),
        }
        # not a field of Hugging Face's Olmo2Config: written only when it is not implied
        if self.head_dim is not None and self.head_dim != self.hidden_dim // self.num_heads:
            config["head_dim"] = self.head_dim
        return config

    def hf_ignored_tensors(self) -> frozenset[str]:
        # a tied checkpoint may still carry a copy of the embeddings as the head
        return frozenset({"lm_head.weight"}) if self.tie_word_embeddings else frozenset()


class Olmo2DecoderLayer(eqx.Module):
    """``x + norm(attn(x))``, then ``x + norm(mlp(x))``."""

    self_attn: Attention
    mlp: GatedMlp
    post_attention_layernorm: RmsNorm
    post_feedforward_layernorm: RmsNorm

    @staticmethod
    def init(config: Olmo2Config, *, key) -> "Olmo2DecoderLayer":
        k_attn, k_mlp = jax.random.split(key, 2)
        return Olmo2DecoderLayer(
            Attention.init(config.attention_config(), key=k_attn),
            GatedMlp.init(
                config.Embed, config.Mlp, config.activation_function, key=k_mlp, std=config.initializer_range
            ),
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon),
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon),
        )

    def __call__(self, x: NamedArray, mask: AttentionMask) -> NamedArray:
        x = x + self.post_attention_layernorm(self.self_attn(x, mask))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(eqx.Module):
    """Token embeddings, the decoder layers, and the final norm (Hugging Face's ``model.``)."""

    config: Olmo2Config = eqx.field(static=True)
    embed_tokens: hnn.Embedding
    layers: hnn.Stacked  # of Olmo2DecoderLayer (hnn.BlockSeq when scan_layers is false)
    norm: RmsNorm

    @staticmethod
    def init(Vocab: Axis, config: Olmo2Config, *, key) -> "Olmo2Model":
        k_embed, k_layers = jax.random.split(key, 2)
        embed = hax.random.normal(k_embed, (Vocab, config.Embed)) * config.initializer_range
        stack = hnn.Stacked if config.scan_layers else hnn.BlockSeq
        layers = stack.init(config.Layers, Olmo2DecoderLayer, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jax.random.split(k_layers, config.num_layers)
        )
        return Olmo2Model(
            config,
            hnn.Embedding(embed, Vocab=Vocab, Embed=config.Embed),
            layers,
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon),
        )

    def __call__(self, input_ids: NamedArray, mask: AttentionMask) -> NamedArray:
        x = self.embed_tokens.embed(input_ids)
        x = self.layers.fold(x, mask, unroll=self.config.unroll_layers)
        return self.norm(x)


class Olmo2LMHeadModel(eqx.Module):
    """OLMo 2 with its output projection (``lm_head``, absent when tied to the embeddings).

    Follows :class:`levanter_core.models.lm.LmHeadModel`."""

    model: Olmo2Model
    lm_head: hnn.Linear | None

    @staticmethod
    def init(Vocab: Axis, config: Olmo2Config, *, key) -> "Olmo2LMHeadModel":
        k_model, k_head = jax.random.split(key, 2)
        head = None
        if not config.tie_word_embeddings:
            head = init_linear(config.Embed, Vocab, key=k_head, std=config.initializer_range)
        return Olmo2LMHeadModel(Olmo2Model.init(Vocab, config, key=k_model), head)

    @property
    def config(self) -> Olmo2Config:
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
        return hax.dot(hidden, self.get_lm_head(), axis=self.config.Embed.name)
