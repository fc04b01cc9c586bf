"""The decoder kit: one decoder-only transformer that every family configures.

A family is a subclass of :class:`DecoderConfig` that states what differs from the
common decoder (Llama's): its defaults, its extra fields, and a few choices, each a class
attribute or a method to override:

==============================  ===========================================================
``norm_placement``              ``pre`` (Llama), ``post`` (OLMo 2), ``sandwich`` (Gemma 2)
``norm_offset``                 1.0 for Gemma's ``(1 + weight)`` RMSNorms
``attention_config()``          biases, QK norm, scale, soft cap, sinks, fused ``qkv_proj``
``attention_module(key=)``      another attention with the same interface (DeepSeek's MLA)
``attention_types()``               per layer ``full_attention`` or ``sliding_attention``
``mlp_module(key=, kind=)``     the feed-forward block of a ``dense`` layer
``moe_config()``                a :class:`~levanter_core.layers.moe.MoeConfig` for the
                                ``moe`` layers (None: a dense model)
``layer_kinds()``               per layer ``dense`` or ``moe`` (DeepSeek's first dense layers)
``embedding_multiplier(dtype)`` Gemma's ``sqrt(hidden_dim)``
``final_logit_soft_cap``        Gemma 2's soft cap of the output logits
``hf_keys`` / ``hf_fields``     the ``config.json`` translation (:mod:`levanter_core.hf.mapping`)
==============================  ===========================================================

The modules keep Hugging Face's names (``model.embed_tokens``, ``model.layers.N.self_attn``,
``mlp``, ``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``, ``model.norm``, ``lm_head``), so import and export are
name-for-name copies and a family adds no serialization code of its own.

Every layer takes the same arguments (``x``, the attention mask, and this layer's
``sliding`` switch); a mixture-of-experts layer also returns its router statistics, which
:class:`DecoderLM` turns into the load-balancing and z-losses. Attention runs in the
three steps of :class:`~levanter_core.layers.attention.Attention` (``project``,
``attend``, ``o_proj``), where decoding with a key/value cache slots in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, Literal, Protocol, Self, TypeAlias

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, AxisSpec, NamedArray
from jax.typing import ArrayLike, DTypeLike
from pydantic import Field, PositiveInt, model_validator

from levanter_core.hf.mapping import DECODER_HF_KEYS, HfKey, HfMapped
from levanter_core.layers.attention import Attention, AttentionBackend, AttentionConfig, AttentionMask
from levanter_core.layers.kv_cache import KvCache
from levanter_core.layers.mlp import ActivationName, GatedMlp, init_linear
from levanter_core.layers.moe import MoeBlock, MoeConfig, RouterStats, router_losses
from levanter_core.layers.norm import RmsNorm
from levanter_core.layers.pipeline import fold_layers, scan_layers
from levanter_core.layers.rotary import DefaultRotaryConfig, RotaryConfig
from levanter_core.layers.stack import LayerGroups, runs, stack_layers
from levanter_core.models.flops import lm_flops_per_token
from levanter_core.models.lm import AuxiliaryLoss, GradientCheckpointing, LmConfig, soft_cap

NormPlacement = Literal["pre", "post", "sandwich"]
LayerType = Literal["full_attention", "sliding_attention"]
"""How one layer attends, in Hugging Face's words: to the whole sequence, or through the sliding window."""
LayerKind = Literal["dense", "moe"]

Sliding: TypeAlias = jax.Array | NamedArray | None
"""A layer's sliding-window switch: a boolean scalar, possibly traced; None: the attention config decides."""


class AttentionLayer(Protocol):
    """What a decoder layer needs of its attention (``self_attn``), as
    :class:`~levanter_core.layers.attention.Attention` and
    :class:`~levanter_core.layers.mla.MultiHeadLatentAttention` offer it: attention over a
    sequence, and its three steps, between which decoding puts a key/value cache."""

    def __call__(
        self, x: NamedArray, mask: AttentionMask, *, sliding: Sliding = None, positions: NamedArray | None = None
    ) -> NamedArray: ...

    def project(
        self, x: NamedArray, *, positions: NamedArray | None = None, sliding: Sliding = None
    ) -> tuple[NamedArray, NamedArray, NamedArray]: ...

    def attend(
        self, q: NamedArray, k: NamedArray, v: NamedArray, mask: AttentionMask, *, sliding: Sliding = None
    ) -> NamedArray: ...

    @property
    def o_proj(self) -> Callable[[NamedArray], NamedArray]: ...


FeedForward = Callable[[NamedArray], Any]
"""A layer's feed-forward block (``mlp``), a module called on ``x``: a dense block returns the
new activations, a :class:`~levanter_core.layers.moe.MoeBlock` them and its :class:`RouterStats`."""


class DecoderConfig(LmConfig, HfMapped):
    """The fields every decoder-only family shares, with Llama 2 7B's defaults; a family
    subclasses it (see the module docstring)."""

    pipeline_parallel: ClassVar[bool] = True

    hf_keys: ClassVar[dict[str, HfKey]] = {
        **DECODER_HF_KEYS,
        "head_dim": HfKey(
            "head_dim", None, read=DECODER_HF_KEYS["head_dim"].read, write=lambda v, c: c.actual_head_dim
        ),
    }

    norm_placement: ClassVar[NormPlacement] = "pre"
    """Where each layer's norms sit: ``pre`` (before attention and MLP), ``post`` (after
    each, on the residual branch), ``sandwich`` (both)."""

    norm_offset: ClassVar[float] = 0.0
    """RMSNorms scale by ``norm_offset + weight`` (Gemma: 1)."""

    hf_layer_names: ClassVar[dict[str, str]] = {}
    """Hugging Face's names for a layer's fields where they differ from the kit's (Mixtral:
    ``{"mlp": "block_sparse_moe"}``); used in checkpoints exchanged with Hugging Face only."""

    seq_len: PositiveInt = 2048
    """The model's context (Hugging Face's ``max_position_embeddings``, Levanter's ``max_seq_len``): the
    length of the training sequences unless the run's ``train_seq_len`` is shorter."""

    hidden_dim: PositiveInt = 4096
    """Width of the residual stream (``hidden_size``)."""

    intermediate_dim: PositiveInt = 11008
    """Width of the MLP's hidden layer (``intermediate_size``)."""

    num_layers: PositiveInt = 32
    """Number of decoder layers (``num_hidden_layers``)."""

    num_heads: PositiveInt = 32
    """Number of query heads (``num_attention_heads``)."""

    num_kv_heads: PositiveInt = 32
    """Number of key/value heads (``num_key_value_heads``): ``num_heads`` for multi-head
    attention, 1 for multi-query, anything dividing ``num_heads`` for grouped-query attention."""

    head_dim: PositiveInt | None = None
    """Size of each head; ``None`` means ``hidden_dim // num_heads``."""

    activation_function: ActivationName = "silu"
    """Nonlinearity of the gated MLP (``hidden_act``)."""

    initializer_range: float = Field(0.02, gt=0.0)
    """Standard deviation of the normal initialization of every weight matrix and embedding."""

    layer_norm_epsilon: float = Field(1e-5, gt=0.0)
    """Epsilon of every RMSNorm (``rms_norm_eps``)."""

    tie_word_embeddings: bool = False
    """Use the token embedding matrix as the output projection."""

    rope: RotaryConfig = DefaultRotaryConfig()
    """Rotary embedding and its scaling: ``{type: default|linear|llama3|yarn|longrope|dynamic,
    theta: ...}``, with ``partial_rotary_factor`` to rotate only part of each head."""

    upcast_attn: bool = False
    """Compute the query-key products in float32 even when the compute precision is lower
    (the softmax always runs in float32)."""

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
    def _check_heads(self) -> Self:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden_dim % self.num_heads:
            raise ValueError(
                f"hidden_dim ({self.hidden_dim}) must be divisible by num_heads ({self.num_heads}) "
                "unless head_dim is set"
            )
        return self

    # -- axes ---------------------------------------------------------------------------------
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

    # -- what a family may change ---------------------------------------------------------------
    def attention_types(self) -> tuple[LayerType, ...]:
        """Each layer's attention: ``full_attention`` or ``sliding_attention`` (which needs a
        ``sliding_window`` field). Default: every layer full."""
        full: LayerType = "full_attention"
        return (full,) * self.num_layers

    def attention_config(self) -> AttentionConfig:
        """The attention layer's settings, from the common fields; a family replaces a few
        (``dataclasses.replace(super().attention_config(), qkv_bias=True)``)."""
        window = getattr(self, "sliding_window", None)
        return AttentionConfig(
            Embed=self.Embed,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.actual_head_dim,
            rope=self.rope,
            sliding_window=window if "sliding_attention" in self.attention_types() else None,
            backend=self.attn_backend,
            query_block=self.flash_attention_block_size,
            upcast=self.upcast_attn,
            initializer_range=self.initializer_range,
        )

    def attention_module(self, *, key: jax.Array) -> AttentionLayer:
        """One layer's attention (``self_attn``): :class:`Attention` of :meth:`attention_config`.
        Another module must offer the same ``__call__(x, mask, *, sliding=None)``. When no layer
        slides, the window is dropped, whatever ``attention_config`` says: the layers get no
        per-layer switch then, and a window in the config would apply to all of them."""
        config = self.attention_config()
        if "sliding_attention" not in self.attention_types():
            config = dataclasses.replace(config, sliding_window=None)
        return Attention.init(config, key=key)

    def mlp_module(self, *, key: jax.Array) -> FeedForward:
        """The feed-forward block of a dense layer (``mlp``): the gated MLP."""
        return GatedMlp.init(self.Embed, self.Mlp, self.activation_function, key=key, std=self.initializer_range)

    def moe_config(self) -> MoeConfig | None:
        """The mixture-of-experts block of the ``moe`` layers; None for a dense model."""
        return None

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's feed-forward block: ``dense`` or ``moe`` (every layer ``moe`` when
        :meth:`moe_config` is set)."""
        kind: LayerKind = "moe" if self.moe_config() is not None else "dense"
        return (kind,) * self.num_layers

    def router_loss_weights(self) -> tuple[float, float]:
        """Weights of the load-balancing loss and the router z-loss (mixture-of-experts families)."""
        return 0.0, 0.0

    def norm(self, axis: AxisSpec | None = None) -> RmsNorm:
        """An RMSNorm over ``axis`` (default ``embed``) with this family's epsilon and offset."""
        return RmsNorm.init(axis or self.Embed, eps=self.layer_norm_epsilon, weight_offset=self.norm_offset)

    def embedding_multiplier(self, dtype: DTypeLike) -> jax.Array | None:
        """A factor applied to the input embeddings (Gemma's ``sqrt(hidden_dim)``); None: none."""
        return None

    @property
    def final_logit_soft_cap(self) -> float | None:
        """Soft cap of the output logits (Gemma 2); the core's loss applies it too."""
        return None

    # -- the core's interface -------------------------------------------------------------------
    def build(self, Vocab: Axis, *, key: jax.Array) -> DecoderLM:
        return DecoderLM.init(Vocab, self, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
        """Counts full attention in every layer, as if no window were set (an upper bound); a
        mixture-of-experts layer counts its chosen and shared experts and the router."""
        moe = self.moe_config()
        kinds = self.layer_kinds()
        common: dict[str, Any] = dict(
            hidden_dim=self.hidden_dim,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.actual_head_dim,
            seq_len=self.seq_len,
            vocab_size=vocab_size,
        )
        dense_layers = kinds.count("dense")
        total = 0.0
        if dense_layers:
            total += lm_flops_per_token(intermediate_dim=self.intermediate_dim, num_layers=dense_layers, **common)
        if moe is not None and dense_layers < len(kinds):
            moe_flops = lm_flops_per_token(
                intermediate_dim=moe.intermediate_dim,
                num_layers=len(kinds) - dense_layers,
                experts_per_token=moe.top_k,
                num_experts=moe.num_experts,
                **common,
            )
            shared = 3.0 * 2 * 3 * self.hidden_dim * moe.shared_intermediate_dim * (len(kinds) - dense_layers)
            total += moe_flops + shared
            if dense_layers:  # the head was counted twice
                total -= 3.0 * 2 * self.hidden_dim * vocab_size
        return total


# -- the modules ----------------------------------------------------------------------------------
def _apply(norm: RmsNorm | None, x: NamedArray) -> NamedArray:
    return x if norm is None else norm(x)


class DecoderLayer(eqx.Module):
    """Attention and a feed-forward block (dense or mixture of experts), each on the residual
    stream, with norms where the family's ``norm_placement`` puts them:

    * ``pre``: ``x + attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``;
    * ``post``: ``x + post_attention_layernorm(attn(x))``, then ``x + post_feedforward_layernorm(mlp(x))``;
    * ``sandwich``: ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
      ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``.

    (Hugging Face calls the pre-MLP norm of ``pre`` models ``post_attention_layernorm``.)"""

    self_attn: AttentionLayer
    mlp: FeedForward
    input_layernorm: RmsNorm | None = None
    post_attention_layernorm: RmsNorm | None = None
    pre_feedforward_layernorm: RmsNorm | None = None
    post_feedforward_layernorm: RmsNorm | None = None
    placement: NormPlacement = eqx.field(static=True, default="pre")
    hf_names: tuple[tuple[str, str], ...] = eqx.field(static=True, default=())

    @staticmethod
    def init(config: DecoderConfig, kind: LayerKind = "dense", *, key: jax.Array) -> DecoderLayer:
        k_attn, k_mlp = jax.random.split(key, 2)
        placement = config.norm_placement
        mlp: FeedForward
        if kind == "moe":
            moe = config.moe_config()
            if moe is None:
                raise ValueError(f"{type(config).__name__}: a moe layer needs moe_config(), which is None")
            mlp = MoeBlock.init(moe, key=k_mlp)
        else:
            mlp = config.mlp_module(key=k_mlp)
        norms = {
            "pre": ("input_layernorm", "post_attention_layernorm"),
            "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
            "sandwich": (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ),
        }[placement]
        return DecoderLayer(
            config.attention_module(key=k_attn),
            mlp,
            **{n: config.norm() for n in norms},
            placement=placement,
            hf_names=tuple(sorted(config.hf_layer_names.items())),
        )

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return dict(self.hf_names)

    def __call__(
        self, x: NamedArray, mask: AttentionMask, sliding: Sliding = None, *, positions: NamedArray | None = None
    ) -> NamedArray | tuple[NamedArray, RouterStats]:
        """``x`` ``(..., position, embed)``; ``sliding`` is this layer's sliding-window switch (None:
        the attention config decides); ``positions`` where ``x``'s tokens sit in their sequences
        (default ``0..position-1``; a decoder with a key/value cache passes later ones). Returns the
        new ``x``, and for a mixture-of-experts layer also its :class:`RouterStats`."""
        return self._residual(x, lambda h: self.self_attn(h, mask, sliding=sliding, positions=positions))

    def decode(
        self,
        x: NamedArray,
        cache: KvCache,
        layer: ArrayLike,
        positions: NamedArray,
        *,
        key_len: int,
        sliding: Sliding = None,
    ) -> tuple[NamedArray, KvCache]:
        """One step of decoding: ``x`` ``(batch, position, embed)`` are new tokens at ``positions``
        (``(batch, position)``); their keys and values go into ``cache`` as layer ``layer``, and
        they attend over the cache's first ``key_len`` positions. Returns the new ``x`` and cache."""
        attn = self.self_attn
        mask = AttentionMask.causal_mask().at_positions(positions)
        written: list[KvCache] = []

        def attend(h: NamedArray) -> NamedArray:
            q, k, v = attn.project(h, positions=positions, sliding=sliding)
            written.append(cache.write(layer, k, v, positions))
            keys, values = written[0].layer(layer, key_len)
            return attn.o_proj(attn.attend(q, keys, values, mask, sliding=sliding))

        out = self._residual(x, attend)
        return (out[0] if isinstance(out, tuple) else out), written[0]

    def _residual(
        self, x: NamedArray, attention: Callable[[NamedArray], NamedArray]
    ) -> NamedArray | tuple[NamedArray, RouterStats]:
        """The layer around ``attention`` (normed input -> attention output)."""
        pre = self.placement == "pre"
        attn_in = self.input_layernorm
        attn_out = None if pre else self.post_attention_layernorm
        mlp_in = self.post_attention_layernorm if pre else self.pre_feedforward_layernorm
        x = x + _apply(attn_out, attention(_apply(attn_in, x)))
        out = self.mlp(_apply(mlp_in, x))
        stats = None
        if isinstance(self.mlp, MoeBlock):
            out, stats = out
        x = x + _apply(self.post_feedforward_layernorm, out)
        return x if stats is None else (x, stats)


class Decoder(eqx.Module):
    """Token embeddings, the decoder layers and the final norm (Hugging Face's ``model.``).

    ``layers`` is one stack (``hnn.Stacked``, or ``hnn.BlockSeq`` without ``scan_layers``)
    when all layers are of one kind, and a :class:`LayerGroups` of stacks otherwise."""

    config: DecoderConfig = eqx.field(static=True)
    embed_tokens: hnn.Embedding
    layers: Any
    norm: RmsNorm

    @staticmethod
    def init(Vocab: Axis, config: DecoderConfig, *, key: jax.Array) -> Decoder:
        k_embed, k_layers = jax.random.split(key, 2)
        embed = hax.random.normal(k_embed, (Vocab, config.Embed)) * config.initializer_range
        groups = runs(config.layer_kinds())
        # one group (most models) takes the layers' key as it is: the same initialization as
        # the families had before the kit
        keys = [k_layers] if len(groups) == 1 else jax.random.split(k_layers, len(groups))
        stacks = [
            stack_layers(
                Axis("layers", length),
                DecoderLayer,
                config,
                kind,
                key=k,
                scan=config.scan_layers,
                gradient_checkpointing=config.gradient_checkpointing,
            )
            for (_, length, kind), k in zip(groups, keys)
        ]
        if len(stacks) == 1:
            layers = stacks[0]
        else:
            layers = LayerGroups(tuple(stacks), tuple(s for s, _, _ in groups), tuple(k for _, _, k in groups))
        return Decoder(config, hnn.Embedding(embed, Vocab=Vocab, Embed=config.Embed), layers, config.norm())

    def sliding_flags(self) -> NamedArray | None:
        """Each layer's sliding-window switch along ``layers``; None when all layers are alike (the
        window, if any, is then fixed, which lets the ``jax`` backend use cuDNN's windowed kernel)."""
        flags = [t == "sliding_attention" for t in self.config.attention_types()]
        if len(set(flags)) == 1:
            return None
        return hax.named(jnp.array(flags), self.config.Layers)

    def __call__(
        self, input_ids: NamedArray, mask: AttentionMask, *, positions: NamedArray | None = None
    ) -> tuple[NamedArray, RouterStats | None]:
        """Final hidden states, and the router statistics of the mixture-of-experts layers stacked
        along ``layers`` (None for a dense model). ``positions``: see :meth:`DecoderLayer.__call__`."""
        c = self.config
        x = self.embed(input_ids)
        stats: list[RouterStats] = []
        for stack, _start, kind, group_flags in self._groups():
            if kind == "moe":
                # the router statistics are means over the tokens, as scan_layers needs in a pipeline
                x, group_stats = scan_layers(stack, x, mask, group_flags, positions=positions, unroll=c.unroll_layers)
                stats.append(group_stats)
            else:
                x = fold_layers(stack, x, mask, group_flags, positions=positions, unroll=c.unroll_layers)
        all_stats: RouterStats | None
        if not stats:
            all_stats = None
        elif len(stats) == 1:
            all_stats = stats[0]
        else:
            all_stats = jax.tree.map(lambda *s: hax.concatenate("layers", s), *stats, is_leaf=hax.is_named_array)
        return self.norm(x), all_stats

    def embed(self, input_ids: NamedArray) -> NamedArray:
        x = self.embed_tokens.embed(input_ids)
        multiplier = self.config.embedding_multiplier(x.dtype)
        return x if multiplier is None else x * multiplier

    def _groups(self) -> Iterator[tuple[Any, int, str, NamedArray | None]]:
        """``(stack, first layer, kind, sliding flags)`` of each group of layers."""
        flags = self.sliding_flags()
        groups: Iterable[tuple[Any, int, str]]
        if isinstance(self.layers, LayerGroups):
            groups = zip(self.layers.groups, self.layers.starts, self.layers.kinds)
        else:
            groups = [(self.layers, 0, self.config.layer_kinds()[0])]
        for stack, start, kind in groups:
            size = stack.Block.size
            yield stack, start, kind, None if flags is None else flags["layers", start : start + size]

    def init_cache(self, Batch: Axis, KeyPos: Axis) -> KvCache:
        """An empty key/value cache for ``Batch`` sequences of up to ``KeyPos.size`` tokens."""
        probe = hax.zeros(
            (Batch.resize(1), Axis("position", 1), self.config.Embed), dtype=self.embed_tokens.weight.dtype
        )
        stack = next(self._groups())[0]
        _, (k, v) = jax.eval_shape(lambda: stack.scan_via(lambda layer, c: (c, layer.self_attn.project(probe)[1:]))(0))
        return KvCache.zeros(self.config.Layers, Batch, KeyPos, k, v)

    def decode(
        self, input_ids: NamedArray, positions: NamedArray, cache: KvCache, *, key_len: int
    ) -> tuple[NamedArray, KvCache]:
        """Final hidden states of new tokens ``input_ids`` ``(batch, position)`` at ``positions``,
        attending over the first ``key_len`` positions of ``cache``; and the cache with their keys
        and values added (see :meth:`DecoderLayer.decode`)."""
        x = self.embed(input_ids)
        for stack, start, _, group_flags in self._groups():

            def step(
                layer: DecoderLayer, carry: tuple[NamedArray, KvCache], index: NamedArray, flag: NamedArray | None
            ) -> tuple[tuple[NamedArray, KvCache], None]:
                x, cache = carry
                return layer.decode(x, cache, index.array, positions, key_len=key_len, sliding=flag), None

            indices = hax.arange(stack.Block) + start
            (x, cache), _ = stack.scan_via(step)((x, cache), indices, group_flags)
        return self.norm(x), cache


class DecoderLM(eqx.Module):
    """A :class:`Decoder` with its output projection (``lm_head``, absent when tied to the
    embeddings). Follows :class:`levanter_core.models.lm.LmHeadModel`, with
    ``activations_with_aux`` for the router's training terms."""

    model: Decoder
    lm_head: hnn.Linear | None

    @staticmethod
    def init(Vocab: Axis, config: DecoderConfig, *, key: jax.Array) -> DecoderLM:
        k_model, k_head = jax.random.split(key, 2)
        head = None
        if not config.tie_word_embeddings:
            head = init_linear(config.Embed, Vocab, key=k_head, std=config.initializer_range)
        return DecoderLM(Decoder.init(Vocab, config, key=k_model), head)

    @property
    def config(self) -> DecoderConfig:
        return self.model.config

    @property
    def Vocab(self) -> Axis:
        return self.model.embed_tokens.Vocab

    def activations(
        self, input_ids: NamedArray, *, key: jax.Array | None = None, attn_mask: AttentionMask | None = None
    ) -> NamedArray:
        """Final hidden states. ``attn_mask`` (default causal) can add document segments."""
        return self.model(input_ids, attn_mask if attn_mask is not None else AttentionMask.causal_mask())[0]

    def activations_with_aux(
        self, input_ids: NamedArray, *, key: jax.Array | None = None, attn_mask: AttentionMask | None = None
    ) -> tuple[NamedArray, AuxiliaryLoss | None]:
        """Final hidden states and, for a mixture of experts, the router's training terms."""
        hidden, stats = self.model(input_ids, attn_mask if attn_mask is not None else AttentionMask.causal_mask())
        if stats is None:
            return hidden, None
        balance, z = self.config.router_loss_weights()
        moe = self.config.moe_config()
        assert moe is not None  # router statistics come from its layers
        return hidden, router_losses(stats, moe.num_experts, balance_weight=balance, z_weight=z)

    def init_cache(self, Batch: Axis, KeyPos: Axis) -> KvCache:
        """An empty key/value cache for decoding (:mod:`levanter_core.inference`)."""
        return self.model.init_cache(Batch, KeyPos)

    def decode(
        self, input_ids: NamedArray, positions: NamedArray, cache: KvCache, *, key_len: int
    ) -> tuple[NamedArray, KvCache]:
        """Final hidden states of new tokens at ``positions`` and the updated cache (see
        :meth:`Decoder.decode`)."""
        return self.model.decode(input_ids, positions, cache, key_len=key_len)

    def get_lm_head(self) -> NamedArray:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return weight.rearrange((self.config.Embed.name, self.Vocab.name))

    def __call__(
        self, input_ids: NamedArray, *, key: jax.Array | None = None, attn_mask: AttentionMask | None = None
    ) -> NamedArray:
        hidden = self.activations(input_ids, key=key, attn_mask=attn_mask)
        logits = hax.dot(hidden, self.get_lm_head(), axis=self.config.Embed.name)
        return soft_cap(logits, self.config.final_logit_soft_cap)


__all__ = [
    "Decoder",
    "DecoderConfig",
    "DecoderLM",
    "DecoderLayer",
    "LayerKind",
    "LayerType",
    "NormPlacement",
]
