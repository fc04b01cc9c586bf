"""Whisper (Radford et al., 2022): a speech-recognition encoder-decoder over Haliax named axes.

The encoder reads a log-mel spectrogram ``(..., mels, frames)``, as ``transformers``'
``WhisperFeatureExtractor`` produces it (80 mel bins by 3,000 frames for 30 seconds): two
convolutions over time with GELU (the second halves the frames), fixed sinusoidal positions,
pre-LayerNorm transformer layers and a final LayerNorm. The decoder embeds tokens with learned
positions and runs pre-LayerNorm layers of causal self-attention, cross-attention to the
encoder's states and a feed-forward block; its logits are its final hidden states times the
token embeddings (the output projection is tied).

The modules carry Hugging Face's field names (``WhisperForConditionalGeneration``:
``model.encoder.conv1``, ``model.decoder.layers.0.encoder_attn.k_proj``, ...), so that import
and export are name-for-name copies through the core's bridge.

Axes: ``mels``, ``frames`` (the spectrogram's), ``source_position`` (the encoder's states,
half the frames), ``position`` (the decoder's tokens), ``key_position`` (whatever attention
attends over), ``embed``, ``heads``, ``head_size``, ``mlp``, ``conv`` (the first
convolution's output channels), ``layers`` (each stack's own), ``vocab``, and any batch axes
in front.
"""

from __future__ import annotations

import math
from typing import ClassVar

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from pydantic import AliasChoices, Field, PositiveInt, model_validator

from levanter_core.errors import ConfigError, UserError
from levanter_core.hf.mapping import HfKey, HfMapped
from levanter_core.layers import ACTIVATIONS, ActivationName, init_linear, stack_layers
from levanter_core.layers.attention import AttentionBackend, AttentionMask, dot_product_attention
from levanter_core.layers.kv_cache import KvCache
from levanter_core.models.lm import GradientCheckpointing, LmConfig

_NO_DROPOUT = (0, 0.0)
_HF_ARCHITECTURES = ("WhisperForConditionalGeneration", "WhisperModel")

NOT_A_LANGUAGE_MODEL = (
    "model.type 'whisper' is a speech-recognition encoder-decoder: its decoder needs the encoder's "
    "states of an audio input, so it cannot be trained, evaluated or sampled as a next-token language "
    "model over text alone. Train it with a speech-recognition objective (audio features and "
    "transcripts), and use encode() and decode() from your own code."
)
"""What the model says when something treats it as a text-only language model."""


class WhisperConfig(LmConfig, HfMapped):
    """The ``model:`` section for ``type: whisper``. Field names are Levanter's (and Hugging
    Face's); defaults are whisper-tiny's."""

    type: str = "whisper"
    """The registered type name; always ``whisper`` for this config."""
    default_hf_checkpoint: ClassVar[str | None] = "openai/whisper-tiny"
    """What ``initialize_from_hf: true`` loads without ``reference_checkpoint``: the checkpoint
    whose shapes the defaults are."""

    objective: ClassVar[str] = "asr"
    """The training objective (``register_objectives``) this model trains with: speech
    recognition, from audio features and transcripts, not next-token prediction over text."""

    hf_architecture: ClassVar[str] = "WhisperForConditionalGeneration"
    hf_model_type: ClassVar[str] = "whisper"
    hf_keys: ClassVar[dict[str, HfKey]] = {
        "seq_len": HfKey("max_target_positions", 448),
        "d_model": HfKey("d_model", 384),
        "num_mel_bins": HfKey("num_mel_bins", 80),
        "max_source_positions": HfKey("max_source_positions", 1500),
        "encoder_layers": HfKey("encoder_layers", 4),
        "encoder_attention_heads": HfKey("encoder_attention_heads", 6),
        "encoder_ffn_dim": HfKey("encoder_ffn_dim", 1536),
        "decoder_layers": HfKey("decoder_layers", 4),
        "decoder_attention_heads": HfKey("decoder_attention_heads", 6),
        "decoder_ffn_dim": HfKey("decoder_ffn_dim", 1536),
        "activation_function": HfKey("activation_function", "gelu"),
        "initializer_range": HfKey("init_std", 0.02),
    }
    # Dropout, layer drop and SpecAugment act in training only, and we train without them:
    # refuse rather than ignore them. The head is always the token embeddings.
    hf_refused: ClassVar[dict[str, tuple]] = {
        "dropout": _NO_DROPOUT,
        "attention_dropout": _NO_DROPOUT,
        "activation_dropout": _NO_DROPOUT,
        "encoder_layerdrop": _NO_DROPOUT,
        "decoder_layerdrop": _NO_DROPOUT,
        "apply_spec_augment": (False,),
        "tie_word_embeddings": (True,),
        "is_encoder_decoder": (True,),
    }

    seq_len: PositiveInt = Field(448, validation_alias=AliasChoices("seq_len", "max_length"))
    """The longest transcript the decoder reads, in tokens: the number of learned decoder positions
    (Hugging Face's ``max_target_positions``; Levanter's name ``max_length`` is accepted too)."""

    vocab_size: PositiveInt | None = None
    """Levanter's field for the size of the vocabulary. Here the vocabulary is the tokenizer's (or
    the imported checkpoint's); when this is set, building a model of another size is an error."""

    num_mel_bins: PositiveInt = Field(80, validation_alias=AliasChoices("num_mel_bins", "num_mels"))
    """Mel bins of the input spectrogram (80; 128 for large-v3). ``num_mels`` is accepted too."""

    max_source_positions: PositiveInt = 1500
    """Positions of the encoder's states: the spectrogram has at most twice as many frames
    (1500 for Whisper's 30 s windows of 3,000 frames)."""

    d_model: PositiveInt = Field(384, validation_alias=AliasChoices("d_model", "hidden_dim"))
    """Width of the residual stream of encoder and decoder (the ``embed`` axis). ``hidden_dim`` is
    accepted too."""

    encoder_layers: PositiveInt = 4
    """Number of encoder layers."""

    encoder_attention_heads: PositiveInt = 6
    """Attention heads of each encoder layer; must divide ``d_model``."""

    encoder_ffn_dim: PositiveInt = 1536
    """Hidden width of the encoder layers' feed-forward blocks."""

    decoder_layers: PositiveInt = 4
    """Number of decoder layers."""

    decoder_attention_heads: PositiveInt = 6
    """Attention heads of each decoder layer (self- and cross-attention); must divide ``d_model``."""

    decoder_ffn_dim: PositiveInt = 1536
    """Hidden width of the decoder layers' feed-forward blocks."""

    activation_function: ActivationName = "gelu"
    """The feed-forward blocks' nonlinearity (the convolutions always use exact GELU)."""

    layer_norm_epsilon: float = Field(1e-5, gt=0.0)
    """Epsilon of every LayerNorm. Hugging Face's Whisper has 1e-5 fixed: another value cannot be
    exported."""

    use_bias: bool = True
    """Biases on the projections, feed-forward layers and LayerNorms (never on the attention's key
    projection, which has none). Hugging Face's Whisper always has them: false cannot be exported."""

    initializer_range: float = Field(0.02, gt=0.0)
    """Standard deviation of the normal initialization of weights and embeddings (``init_std``)."""

    upcast_attn: bool = True
    """Compute the attention scores in float32 even when the compute precision is lower (the
    softmax always is)."""

    attn_backend: AttentionBackend = "auto"
    """Attention implementation: ``reference``, ``jax`` or ``auto`` (see
    ``levanter_core.layers.attention``); Levanter's names are accepted too."""

    gradient_checkpointing: GradientCheckpointing = True
    """Recompute each layer's activations in the backward pass (see
    ``levanter_core.models.lm.GradientCheckpointing``)."""

    scan_layers: bool = True
    """Run each stack of layers as one ``jax.lax.scan`` over stacked parameters rather than
    unrolled. Both read and write the same Hugging Face tensors."""

    @model_validator(mode="after")
    def _heads_divide_d_model(self) -> WhisperConfig:
        if self.d_model % 2:
            raise ValueError(f"d_model ({self.d_model}) must be even: the encoder's positions are sines and cosines")
        for field in ("encoder_attention_heads", "decoder_attention_heads"):
            heads = getattr(self, field)
            if self.d_model % heads:
                raise ValueError(f"d_model ({self.d_model}) must be divisible by {field} ({heads})")
        return self

    # -- axes ------------------------------------------------------------------------------
    @property
    def Embed(self) -> Axis:
        return Axis("embed", self.d_model)

    @property
    def Mels(self) -> Axis:
        return Axis("mels", self.num_mel_bins)

    @property
    def Frames(self) -> Axis:
        """The longest spectrogram the encoder takes: ``2 * max_source_positions`` frames."""
        return Axis("frames", 2 * self.max_source_positions)

    @property
    def SourcePos(self) -> Axis:
        return Axis("source_position", self.max_source_positions)

    @property
    def ConvChannels(self) -> Axis:
        return Axis("conv", self.d_model)

    @property
    def EncoderLayers(self) -> Axis:
        return Axis("layers", self.encoder_layers)

    @property
    def DecoderLayers(self) -> Axis:
        return Axis("layers", self.decoder_layers)

    # -- the core's interface ------------------------------------------------------------------
    def build(self, Vocab: Axis, *, key) -> WhisperModel:
        if self.vocab_size is not None and self.vocab_size != Vocab.size:
            raise ConfigError(
                f"model.vocab_size is {self.vocab_size}, but the vocabulary has {Vocab.size} tokens "
                "(the tokenizer's, or the checkpoint's): leave model.vocab_size out or make them agree"
            )
        return WhisperModel.init(Vocab, self, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
        """Training FLOPs per transcript token (three forward passes' worth), for MFU: each example
        is ``2 * max_source_positions`` frames of audio and ``seq_len`` tokens, and the encoder's
        work on the audio is shared among those tokens.

        Counting 2 FLOPs per multiply-add, with ``d = d_model``, ``S = max_source_positions``,
        ``T = seq_len``, ``M = num_mel_bins`` and ``V = vocab_size``::

            encoder = 2 * (2S * 3 * M * d + S * 3 * d * d)                  # the two convolutions
                    + encoder_layers * S * (2 * (4d^2 + 2 d * encoder_ffn_dim) + 4 S d)
            cross_kv = decoder_layers * S * 2 * 2d^2                         # keys and values of the states
            decoder = decoder_layers * (2 * (6d^2 + 2 d * decoder_ffn_dim) + 4 T d + 4 S d) + 2 d V
            forward = decoder + (encoder + cross_kv) / T

        Attention counts the full square, masked half included, as the other families do."""
        d, S, T, M = self.d_model, self.max_source_positions, self.seq_len, self.num_mel_bins
        encoder = 2 * (2 * S * 3 * M * d + S * 3 * d * d)
        encoder += self.encoder_layers * S * (2 * (4 * d * d + 2 * d * self.encoder_ffn_dim) + 4 * S * d)
        cross_kv = self.decoder_layers * S * 2 * 2 * d * d
        decoder = self.decoder_layers * (2 * (6 * d * d + 2 * d * self.decoder_ffn_dim) + 4 * T * d + 4 * S * d)
        decoder += 2 * d * vocab_size
        return 3.0 * (decoder + (encoder + cross_kv) / T)

    # -- Hugging Face ----------------------------------------------------------------------------
    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        architectures = hf.get("architectures") or []
        others = [a for a in architectures if a not in _HF_ARCHITECTURES]
        if others:
            raise ValueError(
                f"architectures {others} are not supported: the whisper type reads "
                f"{' and '.join(_HF_ARCHITECTURES)} checkpoints"
            )
        return super().hf_fields(hf)

    def to_hf_config(self, vocab_size: int) -> dict:
        if not self.use_bias:
            raise ValueError("use_bias: false has no Hugging Face Whisper equivalent (its layers have biases)")
        if self.layer_norm_epsilon != 1e-5:
            raise ValueError(
                f"layer_norm_epsilon {self.layer_norm_epsilon} has no Hugging Face Whisper equivalent (fixed at 1e-5)"
            )
        # constants of Hugging Face's Whisper that ours always has (hf_refused reads them back)
        return {**super().to_hf_config(vocab_size), "tie_word_embeddings": True, "is_encoder_decoder": True}

    def hf_ignored_tensors(self) -> frozenset[str]:
        return frozenset({"proj_out.weight"})  # the token embeddings, when a checkpoint stores a copy


def sinusoids(Pos: Axis, Embed: Axis) -> NamedArray:
    """Whisper's fixed encoder positions ``(Pos, Embed)``: sines of ``Embed.size / 2`` geometric
    timescales from 1 to 10,000, then cosines of the same."""
    half = Embed.size // 2
    rates = jnp.exp(-math.log(10000.0) / (half - 1) * jnp.arange(half, dtype=jnp.float32))
    angles = jnp.arange(Pos.size, dtype=jnp.float32)[:, None] * rates[None, :]
    return hax.named(jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=1), (Pos, Embed))


_FULL = AttentionMask(causal=False)


# -- unmasked attention on the CPU -------------------------------------------------------------
#
# The encoder attends over 1,500 positions: each head of each row has a 1500 x 1500 matrix of
# weights (9 MB in float32, 432 MB for 8 rows of 6 heads), which the plain computation writes
# and reads again several times and keeps for the backward pass. On a CPU that traffic, not the
# arithmetic, is the cost (whisper-tiny, 8 rows: about half of the training step). Here the rows
# (batch x heads) go through a loop, ``_ROWS_PER_STEP`` at a time, so that one step's weights
# stay in the processor's cache; the backward pass recomputes the weights from the queries, keys
# and the saved log-sum-exp (as flash attention does) instead of keeping them. Accelerators keep
# the core's attention (cuDNN's fused kernel on GPU), which already does this in one kernel.

_ROWS_PER_STEP = 2
"""Rows (of batch x heads) per step of the loop: 2 ran whisper-tiny's encoder attention fastest
on 2 CPU cores (1.6x the plain computation); 1 and 3 were close, 6 slower."""


def _unmasked(mask: AttentionMask) -> bool:
    return not mask.causal and mask.segment_ids is None and mask.query_positions is None


def _attention_by_rows(q: NamedArray, k: NamedArray, v: NamedArray, Pos: str, HeadSize: Axis, *, upcast: bool):
    """Unmasked softmax attention of ``q`` ``(..., Pos, heads, head_size)`` over ``k``/``v``
    ``(..., key_position, heads, head_size)``, one row of batch x heads after another (see above);
    the same values as the core's ``dot_product_attention``, with ``q``'s axes."""
    Heads, QueryPos, KeyPos = q.resolve_axis("heads"), q.resolve_axis(Pos), k.resolve_axis("key_position")
    batch = tuple(ax for ax in q.axes if ax.name not in (QueryPos.name, Heads.name, HeadSize.name))

    def rows(x: NamedArray, Position: Axis) -> jax.Array:
        return x.rearrange((*batch, Heads, Position, HeadSize)).array.reshape(-1, Position.size, HeadSize.size)

    if upcast:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    q = q * jnp.asarray(HeadSize.size**-0.5, q.dtype)
    out = _softmax_attention(rows(q, QueryPos), rows(k, KeyPos), rows(v, KeyPos))
    out = out.reshape(*(ax.size for ax in batch), Heads.size, QueryPos.size, HeadSize.size)
    return hax.named(out, (*batch, Heads, QueryPos, HeadSize)).rearrange(q.axes)


@jax.custom_vjp
def _softmax_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``softmax(q k^T) v`` of scaled queries ``[rows, queries, d]`` over ``[rows, keys, d]``,
    softmax in float32."""
    return _softmax_attention_forward(q, k, v)[0]


def _softmax_attention_forward(q, k, v):
    def row(args):
        q, k, v = args
        scores = (q @ k.T).astype(jnp.float32)
        top = jnp.max(scores, axis=-1, keepdims=True)
        exp = jnp.exp(scores - top)
        total = jnp.sum(exp, axis=-1, keepdims=True)
        out = (exp.astype(v.dtype) @ v).astype(jnp.float32) / total
        return out.astype(v.dtype), top + jnp.log(total)

    out, log_sum = jax.lax.map(row, (q, k, v), batch_size=_ROWS_PER_STEP)
    return out, (q, k, v, out, log_sum)


def _softmax_attention_backward(saved, d_out):
    def row(args):
        q, k, v, out, log_sum, d_out = args
        weights = jnp.exp((q @ k.T).astype(jnp.float32) - log_sum)
        d_v = weights.astype(v.dtype).T @ d_out
        d_weights = (d_out @ v.T).astype(jnp.float32)
        centred = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
        d_scores = weights * (d_weights - centred)
        return d_scores.astype(q.dtype) @ k, d_scores.astype(k.dtype).T @ q, d_v

    return jax.lax.map(row, (*saved, d_out), batch_size=_ROWS_PER_STEP)


_softmax_attention.defvjp(_softmax_attention_forward, _softmax_attention_backward)


class WhisperAttention(eqx.Module):
    """Multi-head attention of queries from ``x`` over keys and values from ``source`` (``x``
    itself in self-attention, the encoder's states in cross-attention). The key projection has no
    bias, as in Whisper."""

    q_proj: hnn.Linear  # embed -> (heads, head_size)
    k_proj: hnn.Linear
    v_proj: hnn.Linear
    out_proj: hnn.Linear  # (heads, head_size) -> embed
    HeadSize: Axis = eqx.field(static=True)
    backend: str = eqx.field(static=True)
    upcast: bool = eqx.field(static=True)
    query_block: int | None = eqx.field(static=True)

    @staticmethod
    def init(config: WhisperConfig, num_heads: int, *, key) -> WhisperAttention:
        c = config
        Heads, HeadSize = Axis("heads", num_heads), Axis("head_size", c.d_model // num_heads)
        k_q, k_k, k_v, k_o = jax.random.split(key, 4)
        std, bias = c.initializer_range, c.use_bias
        return WhisperAttention(
            init_linear(c.Embed, (Heads, HeadSize), key=k_q, std=std, use_bias=bias),
            init_linear(c.Embed, (Heads, HeadSize), key=k_k, std=std, use_bias=False),
            init_linear(c.Embed, (Heads, HeadSize), key=k_v, std=std, use_bias=bias),
            init_linear((Heads, HeadSize), c.Embed, key=k_o, std=std, use_bias=bias),
            HeadSize,
            c.attn_backend,
            c.upcast_attn,
            c.flash_attention_block_size,
        )

    def keys_values(self, source: NamedArray, SourcePos: str) -> tuple[NamedArray, NamedArray]:
        """Keys and values of ``source`` ``(..., SourcePos, embed)``, on ``key_position``."""
        renamed = {SourcePos: "key_position"}
        return self.k_proj(source).rename(renamed), self.v_proj(source).rename(renamed)

    def attend(self, q: NamedArray, k: NamedArray, v: NamedArray, mask: AttentionMask, Pos: str) -> NamedArray:
        """Queries ``q`` ``(..., Pos, heads, head_size)`` over ``k``/``v`` (on ``key_position``),
        then the output projection."""
        # The core's attention lays heads out for grouped queries (its fused GPU kernel needs
        # them so); Whisper's multi-head attention is the case of one query per group.
        grouped = {"heads": "kv_heads"}
        Group = Axis("q_heads_per_group", 1)
        q = hax.broadcast_axis(q.rename(grouped), Group)
        k, v = k.rename(grouped), v.rename(grouped)
        out = dot_product_attention(
            q,
            k,
            v,
            mask,
            Pos=q.resolve_axis(Pos),
            KeyPos=k.resolve_axis("key_position"),
            HeadSize=self.HeadSize,
            scale=self.HeadSize.size**-0.5,
            backend=self.backend,
            query_block=self.query_block,
            upcast=self.upcast,
        )
        return self.out_proj(out[Group.name, 0].rename({"kv_heads": "heads"}))

    def __call__(self, x: NamedArray, source: NamedArray, mask: AttentionMask, *, Pos: str, SourcePos: str):
        k, v = self.keys_values(source, SourcePos)
        q = self.q_proj(x)
        if self.backend == "auto" and _unmasked(mask) and jax.default_backend() == "cpu":
            return self.out_proj(_attention_by_rows(q, k, v, Pos, self.HeadSize, upcast=self.upcast))
        return self.attend(q, k, v, mask, Pos)


def _feed_forward(layer, x: NamedArray) -> NamedArray:
    return layer.fc2(ACTIVATIONS[layer.activation](layer.fc1(layer.final_layer_norm(x))))


def _layer_norm(config: WhisperConfig) -> hnn.LayerNorm:
    return hnn.LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_bias=config.use_bias)


def _mlp_pair(config: WhisperConfig, Mlp: Axis, *, key) -> tuple[hnn.Linear, hnn.Linear]:
    k1, k2 = jax.random.split(key)
    std, bias = config.initializer_range, config.use_bias
    return (
        init_linear(config.Embed, Mlp, key=k1, std=std, use_bias=bias),
        init_linear(Mlp, config.Embed, key=k2, std=std, use_bias=bias),
    )


class WhisperEncoderLayer(eqx.Module):
    """``x + self_attn(self_attn_layer_norm(x))``, then ``x + fc2(act(fc1(final_layer_norm(x))))``,
    over the encoder's positions (no mask: every frame sees every frame)."""

    self_attn: WhisperAttention
    self_attn_layer_norm: hnn.LayerNorm
    fc1: hnn.Linear
    fc2: hnn.Linear
    final_layer_norm: hnn.LayerNorm
    activation: str = eqx.field(static=True)

    @staticmethod
    def init(config: WhisperConfig, *, key) -> WhisperEncoderLayer:
        k_attn, k_mlp = jax.random.split(key)
        fc1, fc2 = _mlp_pair(config, Axis("mlp", config.encoder_ffn_dim), key=k_mlp)
        attn = WhisperAttention.init(config, config.encoder_attention_heads, key=k_attn)
        return WhisperEncoderLayer(attn, _layer_norm(config), fc1, fc2, _layer_norm(config), config.activation_function)

    def __call__(self, x: NamedArray) -> NamedArray:
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn(h, h, _FULL, Pos="source_position", SourcePos="source_position")
        return x + _feed_forward(self, x)


class WhisperDecoderLayer(eqx.Module):
    """Causal self-attention, cross-attention to the encoder's states, and a feed-forward block,
    each ``x + sublayer(norm(x))``."""

    self_attn: WhisperAttention
    self_attn_layer_norm: hnn.LayerNorm
    encoder_attn: WhisperAttention
    encoder_attn_layer_norm: hnn.LayerNorm
    fc1: hnn.Linear
    fc2: hnn.Linear
    final_layer_norm: hnn.LayerNorm
    activation: str = eqx.field(static=True)

    @staticmethod
    def init(config: WhisperConfig, *, key) -> WhisperDecoderLayer:
        k_self, k_cross, k_mlp = jax.random.split(key, 3)
        heads = config.decoder_attention_heads
        fc1, fc2 = _mlp_pair(config, Axis("mlp", config.decoder_ffn_dim), key=k_mlp)
        return WhisperDecoderLayer(
            WhisperAttention.init(config, heads, key=k_self),
            _layer_norm(config),
            WhisperAttention.init(config, heads, key=k_cross),
            _layer_norm(config),
            fc1,
            fc2,
            _layer_norm(config),
            config.activation_function,
        )

    def __call__(self, x: NamedArray, encoder_states: NamedArray, mask: AttentionMask) -> NamedArray:
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn(h, h, mask, Pos="position", SourcePos="position")
        h = self.encoder_attn_layer_norm(x)
        x = x + self.encoder_attn(h, encoder_states, _FULL, Pos="position", SourcePos="source_position")
        return x + _feed_forward(self, x)

    def decode(self, x: NamedArray, layer, cache: WhisperCache, positions: NamedArray, *, key_len: int):
        """New tokens ``x`` at ``positions``: their keys and values go into layer ``layer`` of the
        cache, they attend over its first ``key_len`` positions, then over the encoder's states."""
        h = self.self_attn_layer_norm(x)
        q = self.self_attn.q_proj(h)
        own = cache.self_attn.write(layer, self.self_attn.k_proj(h), self.self_attn.v_proj(h), positions)
        k, v = own.layer(layer, key_len)
        x = x + self.self_attn.attend(q, k, v, AttentionMask.causal_mask().at_positions(positions), "position")
        h = self.encoder_attn_layer_norm(x)
        k, v = cache.cross_attn.layer(layer, cache.cross_attn.KeyPos.size)
        x = x + self.encoder_attn.attend(self.encoder_attn.q_proj(h), k, v, _FULL, "position")
        return x + _feed_forward(self, x), WhisperCache(own, cache.cross_attn)


class WhisperCache(eqx.Module):
    """What the decoder keeps between decoding steps: its self-attention's keys and values
    (``KvCache``, filled token by token) and each layer's keys and values of the encoder's states
    (computed once, by :meth:`WhisperModel.init_decoder_cache`), both ``(layers, batch, heads,
    key_position, head_size)``."""

    self_attn: KvCache
    cross_attn: KvCache

    def insert(self, rows, other: WhisperCache) -> WhisperCache:
        """The cache with ``other``'s rows (all of them: their tokens so far and their audio) put
        at ``rows`` (an integer array), for an engine that starts a new transcription in a row
        while the others go on. Both caches are for audio of the same length."""
        return WhisperCache(
            self.self_attn.insert(rows, other.self_attn), self.cross_attn.insert(rows, other.cross_attn)
        )


class WhisperEncoder(eqx.Module):
    """Hugging Face's ``model.encoder``: the convolutional front end, the fixed positions, the
    layers and the final LayerNorm."""

    config: WhisperConfig = eqx.field(static=True)
    conv1: hnn.Conv  # (mels, frames) -> (conv, frames)
    conv2: hnn.Conv  # (conv, frames) -> (embed, frames / 2)
    embed_positions: hnn.Embedding  # (source_position, embed), kept fixed
    layers: hnn.Stacked  # hnn.BlockSeq without scan_layers
    layer_norm: hnn.LayerNorm

    @staticmethod
    def init(config: WhisperConfig, *, key) -> WhisperEncoder:
        c = config
        k_conv1, k_conv2, k_layers = jax.random.split(key, 3)
        conv1 = _conv(c.Mels, c.ConvChannels, stride=1, std=c.initializer_range, key=k_conv1)
        conv2 = _conv(c.ConvChannels, c.Embed, stride=2, std=c.initializer_range, key=k_conv2)
        positions = hnn.Embedding(sinusoids(c.SourcePos, c.Embed), Vocab=c.SourcePos, Embed=c.Embed)
        layers = stack_layers(
            c.EncoderLayers,
            WhisperEncoderLayer,
            c,
            key=k_layers,
            scan=c.scan_layers,
            gradient_checkpointing=c.gradient_checkpointing,
        )
        return WhisperEncoder(c, conv1, conv2, positions, layers, _layer_norm(c))

    def __call__(self, features: NamedArray) -> NamedArray:
        c = self.config
        frames = features.resolve_axis("frames").size
        if frames > c.Frames.size:
            raise ValueError(
                f"the spectrogram has {frames} frames; the encoder takes at most {c.Frames.size} "
                f"(2 * max_source_positions)"
            )
        x = features.astype(self.conv1.weight.dtype)
        x = hnn.gelu(self.conv1(x), approximate=False)
        x = hnn.gelu(self.conv2(x), approximate=False).rename({"frames": "source_position"})
        # Whisper's positions are fixed (Hugging Face stores them but never trains them)
        positions = jax.lax.stop_gradient(self.embed_positions.weight)
        x = x + positions["source_position", : x.resolve_axis("source_position").size]
        x = self.layers.fold(x, unroll=c.unroll_layers)
        return self.layer_norm(x)


def _conv(In: Axis, Out: Axis, *, stride: int, std: float, key) -> hnn.Conv:
    """A convolution over ``frames`` with kernel 3 and padding 1, its weight ``(Out, In, frames=3)``
    the layout of PyTorch's ``Conv1d``."""
    conv = hnn.Conv.init("frames", In, Out, kernel_size=3, stride=stride, padding=1, key=key)
    weight = hax.random.normal(key, conv.weight.axes) * std
    return eqx.tree_at(lambda m: (m.weight, m.bias), conv, (weight, hax.zeros(Out)))


class WhisperDecoder(eqx.Module):
    """Hugging Face's ``model.decoder``: token and learned position embeddings, the layers and the
    final LayerNorm."""

    config: WhisperConfig = eqx.field(static=True)
    embed_tokens: hnn.Embedding  # (vocab, embed); also the output projection
    embed_positions: hnn.Embedding  # (position, embed)
    layers: hnn.Stacked  # hnn.BlockSeq without scan_layers
    layer_norm: hnn.LayerNorm

    @staticmethod
    def init(Vocab: Axis, config: WhisperConfig, *, key) -> WhisperDecoder:
        c = config
        k_tok, k_pos, k_layers = jax.random.split(key, 3)
        std = c.initializer_range
        tokens = hnn.Embedding(hax.random.normal(k_tok, (Vocab, c.Embed)) * std, Vocab=Vocab, Embed=c.Embed)
        positions = hnn.Embedding(hax.random.normal(k_pos, (c.Pos, c.Embed)) * std, Vocab=c.Pos, Embed=c.Embed)
        layers = stack_layers(
            c.DecoderLayers,
            WhisperDecoderLayer,
            c,
            key=k_layers,
            scan=c.scan_layers,
            gradient_checkpointing=c.gradient_checkpointing,
        )
        return WhisperDecoder(c, tokens, positions, layers, _layer_norm(c))

    def embed(self, token_ids: NamedArray, positions: NamedArray) -> NamedArray:
        return self.embed_tokens.embed(token_ids) + self.embed_positions.embed(positions)

    def __call__(self, token_ids: NamedArray, encoder_states: NamedArray, mask: AttentionMask) -> NamedArray:
        Pos = token_ids.resolve_axis("position")
        if Pos.size > self.config.seq_len:
            raise ValueError(f"{Pos.size} tokens; the decoder has positions for {self.config.seq_len} (seq_len)")
        x = self.embed(token_ids, hax.arange(Pos))
        x = self.layers.fold(x, encoder_states, mask, unroll=self.config.unroll_layers)
        return self.layer_norm(x)

    def decode_step(self, token_ids: NamedArray, positions: NamedArray, cache: WhisperCache, *, key_len: int):
        def step(layer, carry):
            x, cache, index = carry
            x, cache = layer.decode(x, index, cache, positions, key_len=key_len)
            return (x, cache, index + 1), None

        x = self.embed(token_ids, positions)
        (x, cache, _), _ = self.layers.scan_via(step)((x, cache, jnp.asarray(0, dtype=jnp.int32)))
        return self.layer_norm(x), cache


class WhisperEncoderDecoder(eqx.Module):
    """Hugging Face's ``WhisperModel`` (``model.`` in ``WhisperForConditionalGeneration``)."""

    encoder: WhisperEncoder
    decoder: WhisperDecoder


class WhisperModel(eqx.Module):
    """Whisper with its output projection tied to the token embeddings.

    The forward API a speech-recognition objective uses:

    * :meth:`encode` ``(features)``: the encoder's states ``(..., source_position, embed)`` of
      log-mel spectrograms ``(..., mels, frames)`` (at most ``2 * max_source_positions``
      frames; Whisper was trained on exactly 3,000, 30 s padded with silence);
    * :meth:`decode` ``(token_ids, encoder_states, *, attn_mask=None, key=None)``: logits
      ``(..., position, vocab)`` of the next token after each of ``token_ids`` ``(...,
      position)``; :meth:`decoder_activations` gives the final hidden states instead, for a
      loss fused with :meth:`get_lm_head`;
    * :meth:`__call__` ``(features, token_ids)``: both at once.

    Incremental decoding (one new token at a time, for transcription): :meth:`init_decoder_cache`
    computes every layer's cross-attention keys and values once, and :meth:`decode_step` runs new
    tokens against the cache. With :attr:`encoder_input_axes` and :meth:`start_decoding` they are
    the encoder-decoder interface of the core's generation engine
    (:mod:`levanter_core.inference.decoding`), which then transcribes spectrograms in its slots.
    The text-only interface (``activations``, ``init_cache``) refuses with
    :data:`NOT_A_LANGUAGE_MODEL`, so that the language-model trainer and evaluation stop with
    that message rather than fail obscurely.
    """

    model: WhisperEncoderDecoder

    @staticmethod
    def init(Vocab: Axis, config: WhisperConfig, *, key) -> WhisperModel:
        k_enc, k_dec = jax.random.split(key)
        encoder = WhisperEncoder.init(config, key=k_enc)
        return WhisperModel(WhisperEncoderDecoder(encoder, WhisperDecoder.init(Vocab, config, key=k_dec)))

    @property
    def config(self) -> WhisperConfig:
        return self.model.decoder.config

    @property
    def Vocab(self) -> Axis:
        return self.model.decoder.embed_tokens.Vocab

    def get_lm_head(self) -> NamedArray:
        """The output projection, axes ``(embed, vocab)``: the token embedding matrix."""
        return self.model.decoder.embed_tokens.weight.rearrange(("embed", self.Vocab.name))

    def encode(self, features: NamedArray, *, key=None) -> NamedArray:
        """The encoder's final states ``(..., source_position, embed)`` of log-mel spectrograms
        ``(..., mels, frames)``. ``key`` is accepted for symmetry (Whisper has no dropout)."""
        return self.model.encoder(features)

    def decoder_activations(
        self, token_ids: NamedArray, encoder_states: NamedArray, *, attn_mask: AttentionMask | None = None, key=None
    ) -> NamedArray:
        """The decoder's final hidden states ``(..., position, embed)`` for ``token_ids``
        ``(..., position)`` attending causally to each other (``attn_mask``: another
        ``AttentionMask``, e.g. with segments) and fully to ``encoder_states``."""
        mask = AttentionMask.causal_mask() if attn_mask is None else attn_mask
        return self.model.decoder(token_ids, encoder_states, mask)

    def decode(
        self, token_ids: NamedArray, encoder_states: NamedArray, *, attn_mask: AttentionMask | None = None, key=None
    ) -> NamedArray:
        """Logits ``(..., position, vocab)``: position ``t`` predicts the token after ``token_ids[t]``."""
        hidden = self.decoder_activations(token_ids, encoder_states, attn_mask=attn_mask, key=key)
        return hax.dot(hidden, self.get_lm_head(), axis="embed")

    def __call__(self, features: NamedArray, token_ids: NamedArray, *, attn_mask=None, key=None) -> NamedArray:
        """Logits of ``token_ids`` as transcripts of the spectrograms ``features``."""
        return self.decode(token_ids, self.encode(features), attn_mask=attn_mask, key=key)

    # -- incremental decoding ----------------------------------------------------------------
    def init_decoder_cache(self, encoder_states: NamedArray, KeyPos: Axis) -> WhisperCache:
        """A cache for decoding up to ``KeyPos.size`` tokens of each row of ``encoder_states``
        ``(batch, source_position, embed)`` (one batch axis): an empty self-attention cache and
        every decoder layer's keys and values of the encoder's states."""
        Batch = next(ax for ax in encoder_states.axes if ax.name not in ("source_position", "embed"))

        def project(layer, carry):
            k, v = layer.encoder_attn.keys_values(encoder_states, "source_position")
            order = (Batch.name, "heads", "key_position", "head_size")
            return carry, (k.rearrange(order), v.rearrange(order))

        _, (k, v) = self.model.decoder.layers.scan_via(project)(None)
        like = hax.zeros(k.axes[2:3] + k.axes[4:], dtype=k.dtype)  # (heads, head_size)
        own = KvCache.zeros(self.config.DecoderLayers, Batch, KeyPos, like, like)
        return WhisperCache(own, KvCache(k, v))

    def decode_step(self, token_ids: NamedArray, positions: NamedArray, cache: WhisperCache, *, key_len: int):
        """Final hidden states ``(batch, position, embed)`` of new tokens ``token_ids`` ``(batch,
        position)`` at ``positions`` (same axes), attending over the first ``key_len`` positions of
        the cache and over the encoder's states, and the updated cache. Logits: ``hax.dot(hidden,
        model.get_lm_head(), axis="embed")``."""
        return self.model.decoder.decode_step(token_ids, positions, cache, key_len=key_len)

    # -- the generation engine's encoder-decoder interface -------------------------------------
    @property
    def encoder_input_axes(self) -> tuple[Axis, Axis]:
        """What one transcription starts from: a whole window's log-mel spectrogram ``(mels,
        frames)``, ``2 * max_source_positions`` frames (3,000 for 30 s), padded as Whisper pads."""
        return (self.config.Mels, self.config.Frames)

    def start_decoding(self, features: NamedArray, KeyPos: Axis) -> WhisperCache:
        """A cache for transcribing each row of ``features`` ``(batch, mels, frames)``, up to
        ``KeyPos.size`` tokens: the encoder runs once, and its states' keys and values wait in the
        cross-attention cache."""
        return self.init_decoder_cache(self.encode(features), KeyPos)

    # -- the text-only language-model interface, refused ----------------------------------------
    def activations(self, input_ids: NamedArray, *, key=None, attn_mask=None) -> NamedArray:
        """Refused: Whisper's decoder needs audio (see :data:`NOT_A_LANGUAGE_MODEL`)."""
        raise ConfigError(NOT_A_LANGUAGE_MODEL)

    def init_cache(self, Batch: Axis, KeyPos: Axis):
        """Refused: the text generation engine has no audio to give (see :data:`NOT_A_LANGUAGE_MODEL`)."""
        raise UserError(NOT_A_LANGUAGE_MODEL)
