"""GPT-2 (Radford et al., 2019) over Haliax named axes.

The modules are built bottom-up: MLP, attention, block (pre-LayerNorm), the
stack of blocks, embeddings, and the LM head model, whose output projection is
the token embedding matrix (tied, as in GPT-2).

Axes used throughout: ``position`` and its alias ``key_position``, ``embed``,
``heads``, ``head_size``, ``mlp``, ``layers``, ``vocab`` and any batch axes the
caller puts in front.
"""

from __future__ import annotations

import math
from typing import Annotated, Callable, Literal

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from haliax.jax_utils import maybe_rng_split
from pydantic import Field, PositiveInt, model_validator

from levanter_core.layers.attention import AttentionMask, dot_product_attention
from levanter_core.models.lm import LmConfig

Probability = Annotated[float, Field(ge=0.0, lt=1.0)]

ActivationName = Literal["gelu_new", "gelu", "relu", "silu", "quick_gelu"]

_ACTIVATIONS: dict[str, Callable[[NamedArray], NamedArray]] = {
    "gelu_new": lambda x: hnn.gelu(x, approximate=True),  # GPT-2's tanh approximation
    "gelu": lambda x: hnn.gelu(x, approximate=False),
    "relu": hnn.relu,
    "silu": hnn.silu,
    "quick_gelu": hnn.quick_gelu,
}


class Gpt2Config(LmConfig):
    """The ``model:`` section for ``type: gpt2``."""

    type: str = "gpt2"
    """The registered type name; always ``gpt2`` for this config."""

    seq_len: PositiveInt = 1024
    """Length of the training sequences, and the number of learned position embeddings."""

    hidden_dim: PositiveInt = 768
    """Width of the residual stream (the ``embed`` axis)."""

    num_layers: PositiveInt = 12
    """Number of transformer blocks."""

    num_heads: PositiveInt = 12
    """Number of attention heads; must divide ``hidden_dim``."""

    mlp_scale: PositiveInt = 4
    """The MLP's hidden width is ``hidden_dim * mlp_scale``."""

    initializer_range: float = Field(0.02, gt=0.0)
    """Standard deviation of the normal initialization of weight matrices and embeddings.
    The two projections that write into the residual stream in each block use
    ``initializer_range / sqrt(2 * num_layers)``, as GPT-2 does."""

    embed_pdrop: Probability = 0.0
    """Dropout probability applied to the sum of token and position embeddings."""

    resid_pdrop: Probability = 0.0
    """Dropout probability applied to the attention and MLP outputs before they are
    added to the residual stream."""

    attn_pdrop: Probability = 0.0
    """Dropout probability applied to the attention weights."""

    layer_norm_epsilon: float = Field(1e-5, gt=0.0)
    """Epsilon added to the variance in every LayerNorm."""

    activation_function: ActivationName = "gelu_new"
    """The MLP's nonlinearity: ``gelu_new`` (GPT-2's tanh approximation of GELU),
    ``gelu`` (exact), ``relu``, ``silu`` or ``quick_gelu``."""

    scale_attn_by_inverse_layer_idx: bool = False
    """Also divide the attention scores of layer ``i`` (counting from 0) by ``i + 1``,
    which stabilizes training of deep models (as in Mistral's GPT-2 runs)."""

    upcast_attn: bool = False
    """Compute the attention scores (query-key products) in float32 even when the compute
    precision is lower. The softmax always runs in float32."""

    gradient_checkpointing: bool = True
    """Recompute each block's activations in the backward pass instead of storing them:
    less memory for about a third more compute."""

    use_bias: bool = True
    """Whether the linear projections have biases."""

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> "Gpt2Config":
        if self.hidden_dim % self.num_heads != 0:
            raise ValueError(
                f"hidden_dim ({self.hidden_dim}) must be divisible by num_heads ({self.num_heads}); "
                f"each head gets hidden_dim / num_heads dimensions"
            )
        return self

    # -- axes ------------------------------------------------------------------------
    @property
    def Embed(self) -> Axis:
        return Axis("embed", self.hidden_dim)

    @property
    def Heads(self) -> Axis:
        return Axis("heads", self.num_heads)

    @property
    def HeadSize(self) -> Axis:
        return Axis("head_size", self.hidden_dim // self.num_heads)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.hidden_dim * self.mlp_scale)

    @property
    def Layers(self) -> Axis:
        return Axis("layers", self.num_layers)

    # -- the core's interface ----------------------------------------------------------
    def build(self, Vocab: Axis, *, key) -> "Gpt2LMHeadModel":
        return Gpt2LMHeadModel.init(Vocab, self, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
        """Training FLOPs per token: three times the forward pass (forward, and a
        backward that costs twice as much).

        Counting 2 FLOPs per multiply-add, with ``h = hidden_dim``, ``m = h * mlp_scale``,
        ``L = num_layers``, ``s = seq_len`` and ``V = vocab_size``::

            forward = 2 * (L * (4*h*h + 2*h*m) + h*V)   # qkv + output projections, MLP, LM head
                    + 4 * L * s * h                      # attention scores and weighted values

        The attention term counts the full ``s x s`` map even though half of it is
        masked, as Megatron-LM and Levanter do. Embedding lookups, LayerNorms and
        softmax are negligible and not counted.
        """
        h, m, L, s = self.hidden_dim, self.hidden_dim * self.mlp_scale, self.num_layers, self.seq_len
        forward = 2 * (L * (4 * h * h + 2 * h * m) + h * vocab_size) + 4 * L * s * h
        return 3.0 * forward


def _normal_linear(In, Out, *, key, std: float, use_bias: bool) -> hnn.Linear:
    """A Linear layer with N(0, std) weights and zero biases, as GPT-2 initializes them."""
    weight = hax.random.normal(key, hax.concat_axis_specs(Out, In)) * std
    bias = hax.zeros(Out) if use_bias else None
    return hnn.Linear(weight=weight, bias=bias, In=In, Out=Out)


def _dropout(x: NamedArray, pdrop: float, key) -> NamedArray:
    """Dropout during training; ``key=None`` means inference and disables it."""
    return hnn.dropout(x, pdrop, inference=key is None, key=key)


class Gpt2Mlp(eqx.Module):
    """The feed-forward sublayer: ``embed -> mlp -> activation -> embed``."""

    c_fc: hnn.Linear
    c_proj: hnn.Linear
    activation: Callable[[NamedArray], NamedArray] = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2Config, *, key) -> "Gpt2Mlp":
        k_fc, k_proj = jax.random.split(key, 2)
        residual_std = config.initializer_range / math.sqrt(2 * config.num_layers)
        c_fc = _normal_linear(
            config.Embed, config.Mlp, key=k_fc, std=config.initializer_range, use_bias=config.use_bias
        )
        c_proj = _normal_linear(config.Mlp, config.Embed, key=k_proj, std=residual_std, use_bias=config.use_bias)
        return Gpt2Mlp(c_fc, c_proj, _ACTIVATIONS[config.activation_function])

    def __call__(self, x: NamedArray) -> NamedArray:
        return self.c_proj(self.activation(self.c_fc(x)))


class Gpt2Attention(eqx.Module):
    """Causal multi-head self-attention with one fused projection for queries, keys and values."""

    config: Gpt2Config = eqx.field(static=True)
    c_attn: hnn.Linear  # embed -> (qkv, heads, head_size)
    c_proj: hnn.Linear  # (heads, head_size) -> embed

    @staticmethod
    def init(config: Gpt2Config, *, key) -> "Gpt2Attention":
        k_attn, k_proj = jax.random.split(key, 2)
        Qkv = Axis("qkv", 3)
        residual_std = config.initializer_range / math.sqrt(2 * config.num_layers)
        c_attn = _normal_linear(
            config.Embed,
            (Qkv, config.Heads, config.HeadSize),
            key=k_attn,
            std=config.initializer_range,
            use_bias=config.use_bias,
        )
        c_proj = _normal_linear(
            (config.Heads, config.HeadSize), config.Embed, key=k_proj, std=residual_std, use_bias=config.use_bias
        )
        return Gpt2Attention(config, c_attn, c_proj)

    def __call__(self, x: NamedArray, layer_idx: NamedArray, attn_mask=None, *, key=None) -> NamedArray:
        """``x`` has axes ``(..., position, embed)``; ``layer_idx`` is this block's index (a scalar);
        ``attn_mask`` an ``AttentionMask`` (None: causal)."""
        config = self.config
        Pos = x.resolve_axis(config.Pos.name)
        KeyPos = Pos.alias(config.KeyPos.name)

        # One transpose of the fused projection puts heads before positions for all three.
        qkv = self.c_attn(x).rearrange((..., "qkv", config.Heads, Pos, config.HeadSize))
        q, k, v = hax.unbind(qkv, "qkv")
        k = k.rename({Pos.name: KeyPos.name})
        v = v.rename({Pos.name: KeyPos.name})
        if config.upcast_attn:
            q, k = q.astype(jnp.float32), k.astype(jnp.float32)

        scale = 1.0 / math.sqrt(config.HeadSize.size)
        if config.scale_attn_by_inverse_layer_idx:
            # keep the query's dtype: a float32 scale would silently upcast low-precision compute
            scale = (scale / (layer_idx + 1)).astype(q.dtype)

        attended = dot_product_attention(
            q,
            k,
            v,
            AttentionMask.causal_mask() if attn_mask is None else attn_mask,
            Pos=Pos,
            KeyPos=KeyPos,
            HeadSize=config.HeadSize,
            scale=scale,
            backend="reference",
            dropout=config.attn_pdrop,
            key=key,
        )
        return self.c_proj(attended)


class Gpt2Block(eqx.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    config: Gpt2Config = eqx.field(static=True)
    ln_1: hnn.LayerNorm
    attn: Gpt2Attention
    ln_2: hnn.LayerNorm
    mlp: Gpt2Mlp

    @staticmethod
    def init(config: Gpt2Config, *, key) -> "Gpt2Block":
        k_attn, k_mlp = jax.random.split(key, 2)
        return Gpt2Block(
            config,
            hnn.LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon),
            Gpt2Attention.init(config, key=k_attn),
            hnn.LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon),
            Gpt2Mlp.init(config, key=k_mlp),
        )

    def __call__(self, x: NamedArray, layer_idx: NamedArray, attn_mask=None, *, key=None) -> NamedArray:
        k_attn, k_resid_attn, k_resid_mlp = maybe_rng_split(key, 3)
        attn_out = self.attn(self.ln_1(x), layer_idx, attn_mask, key=k_attn)
        x = x + _dropout(attn_out, self.config.resid_pdrop, k_resid_attn)
        mlp_out = self.mlp(self.ln_2(x))
        return x + _dropout(mlp_out, self.config.resid_pdrop, k_resid_mlp)


class Gpt2Transformer(eqx.Module):
    """The stack of blocks (scanned over ``layers``) and the final LayerNorm."""

    config: Gpt2Config = eqx.field(static=True)
    blocks: hnn.Stacked[Gpt2Block]
    ln_f: hnn.LayerNorm

    @staticmethod
    def init(config: Gpt2Config, *, key) -> "Gpt2Transformer":
        blocks = hnn.Stacked.init(config.Layers, Gpt2Block, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jax.random.split(key, config.num_layers)
        )
        return Gpt2Transformer(config, blocks, hnn.LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon))

    def __call__(self, x: NamedArray, attn_mask=None, *, key=None) -> NamedArray:
        # one key per layer, sliced by the scan; None (no dropout) is passed through as is
        keys = jax.random.split(key, self.config.num_layers) if key is not None else None
        x = self.blocks.fold(
            x, hax.arange(self.config.Layers), attn_mask, key=keys, unroll=self.config.unroll_layers
        )
        return self.ln_f(x)


class Gpt2Embeddings(eqx.Module):
    """Token embeddings plus learned absolute position embeddings."""

    config: Gpt2Config = eqx.field(static=True)
    token_embeddings: hnn.Embedding  # (vocab, embed); also the LM head
    position_embeddings: hnn.Embedding  # (position, embed)

    @staticmethod
    def init(Vocab: Axis, config: Gpt2Config, *, key) -> "Gpt2Embeddings":
        k_tok, k_pos = jax.random.split(key, 2)
        Embed, std = config.Embed, config.initializer_range
        token = hnn.Embedding(hax.random.normal(k_tok, (Vocab, Embed)) * std, Vocab=Vocab, Embed=Embed)
        position = hnn.Embedding(hax.random.normal(k_pos, (config.Pos, Embed)) * std, Vocab=config.Pos, Embed=Embed)
        return Gpt2Embeddings(config, token, position)

    @property
    def Vocab(self) -> Axis:
        return self.token_embeddings.Vocab

    def __call__(self, input_ids: NamedArray, *, key=None) -> NamedArray:
        Pos = input_ids.resolve_axis(self.config.Pos.name)
        x = self.token_embeddings.embed(input_ids) + self.position_embeddings.embed(hax.arange(Pos))
        return _dropout(x, self.config.embed_pdrop, key)


class Gpt2LMHeadModel(eqx.Module):
    """GPT-2 with its output projection tied to the token embeddings.

    Follows :class:`levanter_core.models.lm.LmHeadModel`: ``input_ids`` is an integer
    array with axes ``(..., position)``; ``key=None`` runs without dropout.
    """

    transformer: Gpt2Transformer
    embeddings: Gpt2Embeddings

    @staticmethod
    def init(Vocab: Axis, config: Gpt2Config, *, key) -> "Gpt2LMHeadModel":
        k_transformer, k_embeddings = jax.random.split(key, 2)
        return Gpt2LMHeadModel(
            Gpt2Transformer.init(config, key=k_transformer),
            Gpt2Embeddings.init(Vocab, config, key=k_embeddings),
        )

    @property
    def config(self) -> Gpt2Config:
        return self.transformer.config

    @property
    def Vocab(self) -> Axis:
        return self.embeddings.Vocab

    @property
    def Pos(self) -> Axis:
        return self.config.Pos

    def activations(self, input_ids: NamedArray, *, key=None, attn_mask=None) -> NamedArray:
        """Hidden states after the final LayerNorm, axes ``(..., position, embed)``.
        ``attn_mask`` (an ``AttentionMask``; None: causal) keeps packed examples apart."""
        k_embed, k_transformer = maybe_rng_split(key, 2)
        x = self.embeddings(input_ids, key=k_embed)
        return self.transformer(x, attn_mask, key=k_transformer)

    def get_lm_head(self) -> NamedArray:
        """The output projection, axes ``(embed, vocab)``: the token embedding matrix."""
        return self.embeddings.token_embeddings.weight.rearrange((self.config.Embed.name, self.Vocab.name))

    def __call__(self, input_ids: NamedArray, *, key=None) -> NamedArray:
        """Logits, axes ``(..., position, vocab)``."""
        hidden = self.activations(input_ids, key=key)
        return hax.dot(hidden, self.get_lm_head(), axis=self.config.Embed.name)
