"""Hyena (Poli et al., 2023, "Hyena Hierarchy"): GPT-2 with attention replaced by the Hyena
operator, a family without attention (``type: gpt2_hyena``, Levanter's name and fields).

The operator, for an input ``u`` of ``(position, embed)``:

1. ``in_proj`` widens ``u`` to ``order + 1`` streams, and a short causal depthwise
   convolution (``short_filter_order`` taps) mixes each channel with its recent past;
2. the streams are split into ``x_0 .. x_{order-1}`` and ``v``; for each ``x_i`` from the
   last to ``x_1``, the gated ``g = v . x_i`` becomes ``v = h_i * g + D_i . g``: a *long*
   causal convolution over the whole sequence with an implicit filter ``h_i``, plus a skip term;
3. ``y = act(v . x_0)``, then ``out_proj``.

The long filters are not stored position by position: a small MLP with sine activations
(``filter_order`` wide) maps positional features of each position (its normalized time and
``filter_emb_dim - 1`` sinusoids) to the filter values, which an exponential decay then
modulates. The convolution runs through the FFT (``O(L log L)``), zero-padded to twice the
length so that it is causal and not circular; ``num_blocks`` splits the sequence into
independent blocks.

No Hugging Face counterpart: the config is not ``HfConvertible``.
"""

from __future__ import annotations

import math

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from haliax.jax_utils import maybe_rng_split
from pydantic import Field, PositiveInt, model_validator

from levanter_core.config.base import ConfigModel
from levanter_core.layers import ACTIVATIONS, AttentionMask, init_linear, stack_layers
from levanter_core.models.lm import GradientCheckpointing, LmConfig
from levanter_model_gpt2.gpt2 import ActivationName, Gpt2Embeddings, Gpt2Mlp, Probability, _dropout


class HyenaConfig(ConfigModel):
    """The ``hyena:`` section of a ``gpt2_hyena`` model: the operator's settings (Levanter's names)."""

    seq_len: PositiveInt = 1024
    """Longest sequence the operator handles (the length of its implicit filters)."""

    hidden_dim: PositiveInt = 768
    """Width of the residual stream (``embed``)."""

    num_heads: PositiveInt = 1
    """Heads the channels are split into (the filters are shared by the heads)."""

    order: int = Field(2, ge=2)
    """Depth of the recurrence: ``order - 1`` long convolutions, each gated."""

    filter_order: PositiveInt = 16
    """Width of the MLP that generates the implicit filters (Levanter's default; the paper's code uses 64)."""

    short_filter_order: PositiveInt = 3
    """Taps of the short causal convolution after the input projection."""

    outer_mixing: bool = False
    """Gate each channel of the stream by the sum of the gate's channels in its head, the outer
    product summed as in the paper's code (False: elementwise gating)."""

    activation: ActivationName = "gelu_new"
    """Nonlinearity after the recurrence (and of the blocks' MLPs)."""

    num_blocks: PositiveInt = 1
    """Independent blocks the sequence is split into (``seq_len`` must divide by it)."""

    num_hidden_layers_filter_mlp: PositiveInt = 2
    """Hidden layers of the filter MLP."""

    filter_emb_dim: int = Field(3, ge=3)
    """Positional features fed to the filter MLP: normalized time and ``(filter_emb_dim - 1) / 2``
    sine-cosine pairs (odd values use all of them)."""

    filter_dropout: Probability = 0.0
    """Dropout on the long convolutions' outputs, in training."""

    fast_decay_pct: float = Field(0.3, gt=0.0)
    """Fraction of the sequence after which the fastest-decaying filter has fallen to ``target``."""

    slow_decay_pct: float = Field(1.5, gt=0.0)
    """The same for the slowest-decaying filter."""

    target: float = Field(1e-2, gt=0.0, lt=1.0)
    """The value the decays reach at ``fast_decay_pct`` and ``slow_decay_pct``."""

    modulate: bool = True
    """Multiply the filters by their exponential decays."""

    shift: float = 0.0
    """Added to the decays before they multiply the filters."""

    resid_pdrop: Probability = 0.0
    """Dropout on the operator's and the MLP's outputs before the residual additions."""

    use_bias: bool = True
    """Biases on the projections and LayerNorms."""

    @model_validator(mode="after")
    def _shapes(self):
        if self.hidden_dim % self.num_heads:
            raise ValueError(f"hidden_dim ({self.hidden_dim}) must be divisible by num_heads ({self.num_heads})")
        if self.seq_len % self.num_blocks:
            raise ValueError(f"seq_len ({self.seq_len}) must be divisible by num_blocks ({self.num_blocks})")
        return self

    @property
    def Embed(self) -> Axis:
        return Axis("embed", self.hidden_dim)

    @property
    def HeadSize(self) -> Axis:
        return Axis("head_size", self.hidden_dim // self.num_heads)

    @property
    def PosPerBlock(self) -> Axis:
        return Axis("position", self.seq_len // self.num_blocks)


# -- the implicit long filters ------------------------------------------------------------------


def positional_features(length: int, dim: int) -> jax.Array:
    """``[length, dim]``: each position's normalized time ``t`` in ``[0, 1]`` and ``(dim - 1) // 2``
    pairs ``cos(2 pi f n / L)``, ``-sin(2 pi f n / L)`` at frequencies ``f`` from ~0 to
    ``bands - 1`` (an odd leftover column repeats ``t``)."""
    bands = (dim - 1) // 2
    t = jnp.linspace(0.0, 1.0, length)
    angle = 2 * math.pi * jnp.arange(length)[:, None] / length * jnp.linspace(1e-4, bands - 1, bands)[None, :]
    columns = [t[:, None], jnp.cos(angle), -jnp.sin(angle)]
    columns += [t[:, None]] * (dim - 1 - 2 * bands)
    return jnp.concatenate(columns, axis=1).astype(jnp.float32)


class HyenaFilter(eqx.Module):
    """Generates the ``order - 1`` long filters, ``(order_minus_1, position, head_size)``, from
    positional features; ``D`` is the convolutions' skip term."""

    layers: tuple[hnn.Linear, ...]
    frequency: NamedArray  # the sine activations' trainable frequency, (filter_width,)
    decay_rates: NamedArray  # (order_minus_1, head_size), fixed at initialization
    D: NamedArray  # (order_minus_1, head_size)
    config: HyenaConfig = eqx.field(static=True)

    @staticmethod
    def init(config: HyenaConfig, *, key) -> HyenaFilter:
        c = config
        Width, Features = Axis("filter_width", c.filter_order), Axis("filter_features", c.filter_emb_dim)
        Orders = Axis("order_minus_1", c.order - 1)
        keys = jax.random.split(key, c.num_hidden_layers_filter_mlp + 2)
        sizes = [Features] + [Width.alias(f"filter_width{i}") for i in range(c.num_hidden_layers_filter_mlp)]
        layers = [
            hnn.Linear.init(In, Out, key=k, use_bias=c.use_bias) for In, Out, k in zip(sizes[:-1], sizes[1:], keys)
        ]
        layers.append(hnn.Linear.init(sizes[-1], (Orders, c.HeadSize), key=keys[-2], use_bias=c.use_bias))
        # decay rates spread from the slow to the fast one, over every output channel
        fast, slow = math.log(c.target) / c.fast_decay_pct, math.log(c.target) / c.slow_decay_pct
        rates = jnp.abs(jnp.linspace(slow, fast, Orders.size * c.HeadSize.size)).reshape(Orders.size, -1)
        return HyenaFilter(
            tuple(layers),
            hax.ones(Width),
            hax.named(rates, (Orders, c.HeadSize)),
            hax.random.normal(keys[-1], (Orders, c.HeadSize)),
            c,
        )

    def __call__(self, length: int) -> NamedArray:
        """The filters for the first ``length`` positions of a block (the same values whatever
        the length: a shorter sequence sees a prefix of the same filters)."""
        c = self.config
        Pos = Axis("position", length)
        full = c.seq_len // c.num_blocks
        features = positional_features(full, c.filter_emb_dim)[:length]
        h = hax.named(features, (Pos, "filter_features"))
        for layer in self.layers[:-1]:
            h = layer(h)
            width = h.axes[-1]
            h = hax.sin(self.frequency.rename({"filter_width": width.name}) * h)
        h = self.layers[-1](h)
        if c.modulate:
            t = hax.named(jnp.linspace(0.0, 1.0, full)[:length], Pos)
            rates = jax.lax.stop_gradient(self.decay_rates)
            h = h * (hax.exp(-(t.broadcast_axis(rates.axes) * rates)) + c.shift)
        return h


def causal_fft_convolution(u: NamedArray, h: NamedArray, Pos: Axis) -> NamedArray:
    """``y[t] = sum_{s <= t} h[t - s] u[s]`` along ``Pos`` (every other axis of ``h`` must be in
    ``u``), through FFTs of length ``2 * Pos.size`` so that nothing wraps around; float32 inside.
    The filters' transform is taken before they are broadcast over ``u``'s batch axes."""
    n = 2 * Pos.size
    Freq = Axis("frequency", n // 2 + 1)

    def spectrum(x: NamedArray) -> NamedArray:
        f = jnp.fft.rfft(x.array.astype(jnp.float32), n=n, axis=x.axis_indices(Pos.name))
        return hax.named(f, tuple(Freq if a.name == Pos.name else a for a in x.axes))

    product = (spectrum(u) * spectrum(h)).rearrange(tuple(Freq if a.name == Pos.name else a for a in u.axes))
    axis = product.axis_indices(Freq.name)
    y = jax.lax.slice_in_dim(jnp.fft.irfft(product.array, n=n, axis=axis), 0, Pos.size, axis=axis)
    return hax.named(y.astype(u.dtype), u.axes)


class HyenaOperator(eqx.Module):
    """The operator (see the module docstring): projections, short convolution, recurrence."""

    in_proj: hnn.Linear  # embed -> (streams, inner)
    short_filter: NamedArray  # (streams, inner, taps): depthwise causal taps
    short_filter_bias: NamedArray  # (streams, inner)
    filter_fn: HyenaFilter
    out_proj: hnn.Linear
    config: HyenaConfig = eqx.field(static=True)

    @staticmethod
    def init(config: HyenaConfig, *, key, std: float = 0.02) -> HyenaOperator:
        c = config
        k_in, k_short, k_filter, k_out = jax.random.split(key, 4)
        Streams, Taps = Axis("streams", c.order + 1), Axis("taps", c.short_filter_order)
        Inner = c.Embed.alias("inner")
        bound = 1 / math.sqrt(c.short_filter_order)
        return HyenaOperator(
            init_linear(c.Embed, (Streams, Inner), key=k_in, std=std, use_bias=c.use_bias),
            hax.random.uniform(k_short, (Streams, Inner, Taps), minval=-bound, maxval=bound),
            hax.zeros((Streams, Inner)),
            HyenaFilter.init(c, key=k_filter),
            init_linear(c.Embed.alias("inner"), c.Embed, key=k_out, std=std, use_bias=c.use_bias),
            c,
        )

    def _short_convolution(self, u: NamedArray, Pos: Axis) -> NamedArray:
        """Each channel convolved causally with its own ``taps``: ``y[t] = sum_j w[j] u[t - (taps - 1) + j]``."""
        taps = self.config.short_filter_order
        out = u * self.short_filter["taps", taps - 1]
        for j in range(taps - 1):
            shift = taps - 1 - j  # tap j looks this many positions back
            shifted = hax.roll(u, shift, Pos)
            shifted = hax.where(hax.arange(Pos) >= shift, shifted, 0)
            out = out + shifted * self.short_filter["taps", j]
        return out + self.short_filter_bias

    def __call__(self, u: NamedArray, *, key=None) -> NamedArray:
        c = self.config
        Pos = u.resolve_axis("position")
        if Pos.size > c.seq_len or Pos.size % c.num_blocks:
            raise ValueError(
                f"gpt2_hyena handles sequences of at most hyena.seq_len={c.seq_len} positions that divide into "
                f"hyena.num_blocks={c.num_blocks} blocks, not {Pos.size}"
            )
        k_drop = maybe_rng_split(key, 2 * (c.order - 1))  # the gate's and the filter's dropout, per step
        streams = self._short_convolution(self.in_proj(u), Pos)
        if c.num_blocks > 1:
            Block, PerBlock = Axis("hyena_blocks", c.num_blocks), Axis("position", Pos.size // c.num_blocks)
            streams = streams.unflatten_axis(Pos.name, (Block, PerBlock.alias("per_block"))).rename(
                {"per_block": "position"}
            )
        BlockPos = streams.resolve_axis("position")
        Heads = Axis("heads", c.num_heads)
        streams = streams.unflatten_axis("inner", (Heads, c.HeadSize))
        x = [streams["streams", i] for i in range(c.order)]
        v = streams["streams", c.order]
        filters = self.filter_fn(BlockPos.size)
        for step, i in enumerate(range(c.order - 1, 0, -1)):  # x_{order-1} .. x_1, with filter `step`
            # gating: elementwise, or with outer mixing v[d] * sum_d' x_i[d'] within each head
            gated = v * hax.sum(x[i], "head_size") if c.outer_mixing else v * x[i]
            v = _dropout(gated, c.resid_pdrop, k_drop[2 * step])
            h, D = filters["order_minus_1", step], self.filter_fn.D["order_minus_1", step]
            v = causal_fft_convolution(v, h, BlockPos) + v * D
            v = _dropout(v, c.filter_dropout, k_drop[2 * step + 1])
        y = (v * x[0]).flatten_axes((Heads, c.HeadSize), "inner")
        if c.num_blocks > 1:
            y = y.flatten_axes(("hyena_blocks", "position"), "position")
        return self.out_proj(ACTIVATIONS[c.activation](y))


# -- GPT-2 with Hyena ---------------------------------------------------------------------------


class Gpt2HyenaConfig(LmConfig):
    """The ``model:`` section for ``type: gpt2_hyena`` (Levanter's fields): GPT-2's embeddings,
    blocks and head with the Hyena operator in place of attention."""

    type: str = "gpt2_hyena"
    """The registered type name."""

    num_layers: PositiveInt = 12
    """Number of blocks."""

    mlp_scale: PositiveInt = 4
    """The blocks' MLP is ``hyena.hidden_dim * mlp_scale`` wide."""

    initializer_range: float = Field(0.02, gt=0.0)
    """Standard deviation of the normal initialization of the projections and embeddings."""

    embed_pdrop: Probability = 0.0
    """Dropout on the sum of token and position embeddings."""

    layer_norm_epsilon: float = Field(1e-5, gt=0.0)
    """Epsilon of every LayerNorm."""

    gradient_checkpointing: GradientCheckpointing = True
    """Recompute each block's activations in the backward pass (see ``levanter_core.models.lm``)."""

    scan_layers: bool = True
    """Run the blocks as one ``jax.lax.scan`` rather than unrolled."""

    hyena: HyenaConfig = HyenaConfig()
    """The operator's settings, and the model's width (``hyena.hidden_dim``)."""

    @model_validator(mode="before")
    @classmethod
    def _seq_len_from_hyena(cls, data):
        # Levanter gives the length only in the operator's section: the model's follows it
        if isinstance(data, dict) and "seq_len" not in data:
            hyena = data.get("hyena") or {}
            seq_len = hyena.get("seq_len") if isinstance(hyena, dict) else getattr(hyena, "seq_len", None)
            data = {**data, "seq_len": seq_len or HyenaConfig.model_fields["seq_len"].default}
        return data

    @model_validator(mode="after")
    def _lengths_agree(self):
        if self.seq_len > self.hyena.seq_len:
            raise ValueError(
                f"seq_len ({self.seq_len}) exceeds hyena.seq_len ({self.hyena.seq_len}), the length of the filters"
            )
        return self

    # what GPT-2's embeddings and MLP read from a config
    @property
    def Embed(self) -> Axis:
        return self.hyena.Embed

    @property
    def hidden_dim(self) -> int:
        return self.hyena.hidden_dim

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.hyena.hidden_dim * self.mlp_scale)

    @property
    def Layers(self) -> Axis:
        return Axis("layers", self.num_layers)

    @property
    def use_bias(self) -> bool:
        return self.hyena.use_bias

    @property
    def activation_function(self) -> str:
        return self.hyena.activation

    def build(self, Vocab: Axis, *, key) -> Gpt2HyenaModel:
        return Gpt2HyenaModel.init(Vocab, self, key=key)


class Gpt2HyenaBlock(eqx.Module):
    """``x + hyena(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    ln_1: hnn.LayerNorm
    hyena_operator: HyenaOperator
    ln_2: hnn.LayerNorm
    mlp: Gpt2Mlp
    config: Gpt2HyenaConfig = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2HyenaConfig, *, key) -> Gpt2HyenaBlock:
        k_hyena, k_mlp = jax.random.split(key)
        ln_1, ln_2 = (
            hnn.LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_bias=config.use_bias) for _ in range(2)
        )
        return Gpt2HyenaBlock(
            ln_1,
            HyenaOperator.init(config.hyena, key=k_hyena, std=config.initializer_range),
            ln_2,
            Gpt2Mlp.init(config, key=k_mlp),
            config,
        )

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        k_op, k_1, k_2 = maybe_rng_split(key, 3)
        pdrop = self.config.hyena.resid_pdrop
        x = x + _dropout(self.hyena_operator(self.ln_1(x), key=k_op), pdrop, k_1)
        return x + _dropout(self.mlp(self.ln_2(x)), pdrop, k_2)


class Gpt2HyenaModel(eqx.Module):
    """GPT-2's embeddings and tied head around Hyena blocks. Follows
    :class:`levanter_core.models.lm.LmHeadModel`."""

    blocks: hnn.Stacked
    ln_f: hnn.LayerNorm
    embeddings: Gpt2Embeddings

    @staticmethod
    def init(Vocab: Axis, config: Gpt2HyenaConfig, *, key) -> Gpt2HyenaModel:
        k_blocks, k_embed = jax.random.split(key)
        blocks = stack_layers(
            config.Layers,
            Gpt2HyenaBlock,
            config,
            key=k_blocks,
            scan=config.scan_layers,
            gradient_checkpointing=config.gradient_checkpointing,
        )
        ln_f = hnn.LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_bias=config.use_bias)
        return Gpt2HyenaModel(blocks, ln_f, Gpt2Embeddings.init(Vocab, config, key=k_embed))

    @property
    def config(self) -> Gpt2HyenaConfig:
        return self.embeddings.config

    @property
    def Vocab(self) -> Axis:
        return self.embeddings.Vocab

    def activations(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        """Hidden states after the final LayerNorm. The convolutions see the whole sequence, so
        examples packed into one sequence (an ``attn_mask`` with segments) would see each other."""
        if attn_mask is not None and attn_mask.segment_ids is not None:
            raise ValueError(
                "gpt2_hyena cannot train on packed examples: its long convolutions cross the examples' "
                "boundaries (use unpacked data, e.g. a text source without `pack`)"
            )
        k_embed, k_blocks = maybe_rng_split(key, 2)
        keys = jax.random.split(k_blocks, self.config.num_layers) if k_blocks is not None else None
        x = self.embeddings(input_ids, key=k_embed)
        x = self.blocks.fold(x, key=keys, unroll=self.config.unroll_layers)
        return self.ln_f(x)

    def get_lm_head(self) -> NamedArray:
        return self.embeddings.token_embeddings.weight.rearrange((self.config.Embed.name, self.Vocab.name))

    def __call__(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        hidden = self.activations(input_ids, key=key, attn_mask=attn_mask)
        return hax.dot(hidden, self.get_lm_head(), axis=self.config.Embed.name)
