"""GPT-2 (Radford et al., 2019) over Haliax named axes.

The modules are built bottom-up: MLP, attention, block (pre-LayerNorm), the
stack of blocks, embeddings, and the LM head model, whose output projection is
the token embedding matrix (tied, as in GPT-2).

Hugging Face's ``GPT2LMHeadModel`` stores the same parameters under other names
(``transformer.wte``, ``transformer.h.0.attn.c_attn``, ...) and keeps its projections
in ``Conv1D`` layers, whose weights are ``(in, out)`` rather than PyTorch's usual
``(out, in)``. The modules map their field names to Hugging Face's with Haliax's
``_state_dict_key_map`` and transpose the projections only when exporting
(``flatten_for_export``), so that our own checkpoints and initialization stay as they were.

Axes used throughout: ``position`` and its alias ``key_position``, ``embed``,
``heads``, ``head_size``, ``mlp``, ``layers``, ``vocab`` and any batch axes the
caller puts in front.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, ClassVar, Literal

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from haliax.jax_utils import maybe_rng_split
from haliax.state_dict import ModuleWithStateDictSerialization
from pydantic import Field, PositiveInt, model_validator

from levanter_core.hf.mapping import HfKey, HfMapped
from levanter_core.layers import ACTIVATIONS, fold_layers, init_linear, stack_layers
from levanter_core.layers.attention import AttentionBackend, AttentionMask, dot_product_attention
from levanter_core.layers.kv_cache import KvCache
from levanter_core.models.lm import GradientCheckpointing, LmConfig

Probability = Annotated[float, Field(ge=0.0, lt=1.0)]

ActivationName = Literal["gelu_new", "gelu", "relu", "silu", "quick_gelu"]
"""GPT-2's activations (``gelu_new`` is its tanh approximation of GELU), computed by the core's
:data:`~levanter_core.layers.ACTIVATIONS`."""


def _mlp_scale_in(inner, hf: dict) -> int:
    hidden = hf.get("n_embd", 768)
    inner = inner or 4 * hidden
    if inner % hidden:
        raise ValueError(
            f"n_inner ({inner}) must be a multiple of n_embd ({hidden}): the MLP is hidden_dim * mlp_scale wide"
        )
    return inner // hidden


class Gpt2Config(LmConfig, HfMapped):
    """The ``model:`` section for ``type: gpt2``.

    Hugging Face's keys: a ``config.json`` that leaves one out gets ``transformers.GPT2Config``'s
    default (dropout 0.1, as GPT-2 was trained), since that is what ``transformers`` would use."""

    pipeline_parallel: ClassVar[bool] = True

    type: str = "gpt2"
    """The registered type name; always ``gpt2`` for this config."""
    default_hf_checkpoint: ClassVar[str | None] = "gpt2"
    """What ``initialize_from_hf: true`` loads without ``reference_checkpoint`` (Levanter's default)."""

    hf_architecture: ClassVar[str] = "GPT2LMHeadModel"
    hf_model_type: ClassVar[str] = "gpt2"
    hf_keys: ClassVar[dict[str, HfKey]] = {
        "seq_len": HfKey("n_positions", 1024),
        "hidden_dim": HfKey("n_embd", 768),
        "num_layers": HfKey("n_layer", 12),
        "num_heads": HfKey("n_head", 12),
        # null, as transformers writes it, when it is the default 4 * n_embd
        "mlp_scale": HfKey(
            "n_inner", None, read=_mlp_scale_in, write=lambda v, c: None if v == 4 else c.hidden_dim * v
        ),
        "initializer_range": HfKey("initializer_range", 0.02),
        "embed_pdrop": HfKey("embd_pdrop", 0.1),
        "resid_pdrop": HfKey("resid_pdrop", 0.1),
        "attn_pdrop": HfKey("attn_pdrop", 0.1),
        "layer_norm_epsilon": HfKey("layer_norm_epsilon", 1e-5),
        "activation_function": HfKey("activation_function", "gelu_new"),
        "scale_attn_by_inverse_layer_idx": HfKey("scale_attn_by_inverse_layer_idx", False),
        "upcast_attn": HfKey("reorder_and_upcast_attn", False),
    }
    hf_refused: ClassVar[dict[str, tuple]] = {
        "scale_attn_weights": (True,),
        "tie_word_embeddings": (True,),
        "add_cross_attention": (False,),
    }

    seq_len: PositiveInt = 1024
    """The model's context (Levanter's ``max_seq_len``): the number of learned position embeddings, and the
    length of the training sequences unless the run's ``train_seq_len`` is shorter."""

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

    attn_backend: AttentionBackend = "auto"
    """Attention implementation: ``reference`` (plain einsums in causal query blocks), ``jax``
    (``jax.nn.dot_product_attention``, cuDNN's fused attention on GPU) or ``auto`` (``jax`` on
    GPU without attention dropout, ``reference`` elsewhere). Levanter's names are accepted too."""

    gradient_checkpointing: GradientCheckpointing = True
    """Recompute each layer's activations in the backward pass instead of storing them (``true``),
    store them all (``false``), or one of Levanter's policies: ``offload``, ``recompute``,
    ``save_all``, ``nested`` (see ``levanter_core.models.lm.GradientCheckpointing``)."""

    use_bias: bool = True
    """Whether the linear projections have biases. Hugging Face's GPT-2 always has them, so a
    model without cannot be exported."""

    scan_layers: bool = True
    """Run the blocks as one ``jax.lax.scan`` over stacked parameters (fast compilation) rather
    than unrolled (``haliax.nn.BlockSeq``). Both load and export the same Hugging Face tensors."""

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> Gpt2Config:
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
    def build(self, Vocab: Axis, *, key) -> Gpt2LMHeadModel:
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

    # -- Hugging Face ------------------------------------------------------------------------
    def to_hf_config(self, vocab_size: int) -> dict:
        if not self.use_bias:
            raise ValueError("use_bias: false has no Hugging Face GPT-2 equivalent (its projections have biases)")
        # constants of Hugging Face's GPT-2 that ours always has (hf_refused reads them back)
        return {**super().to_hf_config(vocab_size), "scale_attn_weights": True, "tie_word_embeddings": True}

    def hf_ignored_tensors(self) -> frozenset[str]:
        # The head is the token embeddings, though some checkpoints store a copy; older ones
        # also store each layer's causal mask as a buffer (`attn.bias`, `attn.masked_bias`).
        masks = {f"transformer.h.{i}.attn.{name}" for i in range(self.num_layers) for name in ("bias", "masked_bias")}
        return frozenset({"lm_head.weight", *masks})

    def hf_position_tensors(self) -> frozenset[str]:
        # learned position embeddings: a shorter seq_len than the checkpoint's n_positions uses the first rows
        return frozenset({"transformer.wpe.weight"})


def _dropout(x: NamedArray, pdrop: float, key) -> NamedArray:
    """Dropout during training; ``key=None`` means inference and disables it."""
    return hnn.dropout(x, pdrop, inference=key is None, key=key)


def _conv1d_layout(linear: hnn.Linear) -> hnn.Linear:
    """``linear`` with its weight's axes ordered ``(..., in, out)``, the layout of Hugging
    Face's ``Conv1D``, which Haliax's export then flattens as it is."""
    names = [a.name for a in (*hax.axis_spec_to_tuple(linear.In), *hax.axis_spec_to_tuple(linear.Out))]
    return eqx.tree_at(lambda m: m.weight, linear, linear.weight.rearrange((..., *names)))


def _own_layout(linear: hnn.Linear, template: hnn.Linear) -> hnn.Linear:
    """The inverse of :func:`_conv1d_layout` after an import: ``linear`` (possibly still
    flattened) unflattened, with its weight's axes in ``template``'s order."""
    linear = linear.unflatten_from_export(template)
    return eqx.tree_at(lambda m: m.weight, linear, linear.weight.rearrange(template.weight.axes))


class _Conv1dExport(ModuleWithStateDictSerialization):
    """A module whose projections (the fields named in ``_conv1d``) Hugging Face keeps in
    ``Conv1D`` layers: exported in that layout, and put back in ours on import."""

    _conv1d: ClassVar[tuple[str, ...]]

    def _map_linears(self, fn, *others):
        new = [fn(getattr(self, name), *(getattr(o, name) for o in others)) for name in self._conv1d]
        return eqx.tree_at(lambda m: [getattr(m, name) for name in self._conv1d], self, new)

    def flatten_for_export(self):
        return self._map_linears(_conv1d_layout)

    def unflatten_from_export(self, template):
        return self._map_linears(_own_layout, template)


class Gpt2Mlp(_Conv1dExport):
    """The feed-forward sublayer: ``embed -> mlp -> activation -> embed``."""

    _conv1d = ("c_fc", "c_proj")
    c_fc: hnn.Linear
    c_proj: hnn.Linear
    activation: Callable[[NamedArray], NamedArray] = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2Config, *, key) -> Gpt2Mlp:
        k_fc, k_proj = jax.random.split(key, 2)
        residual_std = config.initializer_range / math.sqrt(2 * config.num_layers)
        c_fc = init_linear(config.Embed, config.Mlp, key=k_fc, std=config.initializer_range, use_bias=config.use_bias)
        c_proj = init_linear(config.Mlp, config.Embed, key=k_proj, std=residual_std, use_bias=config.use_bias)
        return Gpt2Mlp(c_fc, c_proj, ACTIVATIONS[config.activation_function])

    def __call__(self, x: NamedArray) -> NamedArray:
        return self.c_proj(self.activation(self.c_fc(x)))


class Gpt2Attention(_Conv1dExport):
    """Causal multi-head self-attention with one fused projection for queries, keys and values.
    Its output axes ``(qkv, heads, head_size)`` flatten, in that order, into Hugging Face's fused
    ``c_attn``: queries, then keys, then values, each split into heads."""

    _conv1d = ("c_attn", "c_proj")
    config: Gpt2Config = eqx.field(static=True)
    c_attn: hnn.Linear  # embed -> (qkv, heads, head_size)
    c_proj: hnn.Linear  # (heads, head_size) -> embed

    @staticmethod
    def init(config: Gpt2Config, *, key) -> Gpt2Attention:
        k_attn, k_proj = jax.random.split(key, 2)
        Qkv = Axis("qkv", 3)
        residual_std = config.initializer_range / math.sqrt(2 * config.num_layers)
        c_attn = init_linear(
            config.Embed,
            (Qkv, config.Heads, config.HeadSize),
            key=k_attn,
            std=config.initializer_range,
            use_bias=config.use_bias,
        )
        c_proj = init_linear(
            (config.Heads, config.HeadSize), config.Embed, key=k_proj, std=residual_std, use_bias=config.use_bias
        )
        return Gpt2Attention(config, c_attn, c_proj)

    def __call__(self, x: NamedArray, layer_idx: NamedArray, attn_mask=None, *, key=None) -> NamedArray:
        """``x`` has axes ``(..., position, embed)``; ``layer_idx`` is this block's index (a scalar);
        ``attn_mask`` an ``AttentionMask`` (None: causal)."""
        q, k, v = self._project(x, layer_idx)
        renamed = {self.config.Pos.name: self.config.KeyPos.name}
        mask = AttentionMask.causal_mask() if attn_mask is None else attn_mask
        return self._attend(q, k.rename(renamed), v.rename(renamed), mask, key=key)

    def decode(self, x: NamedArray, layer_idx, cache: KvCache, positions: NamedArray, *, key_len: int):
        """New tokens ``x`` ``(batch, position, embed)`` at ``positions``: their keys and values go
        into ``cache``, and they attend over its first ``key_len`` positions."""
        q, k, v = self._project(x, layer_idx)
        cache = cache.write(layer_idx, k, v, positions)
        keys, values = cache.layer(layer_idx, key_len)
        return self._attend(q, keys, values, AttentionMask.causal_mask().at_positions(positions)), cache

    def _project(self, x: NamedArray, layer_idx) -> tuple[NamedArray, NamedArray, NamedArray]:
        """Queries, keys and values ``(..., heads, position, head_size)``."""
        config = self.config
        Pos = x.resolve_axis(config.Pos.name)
        # One transpose of the fused projection puts heads before positions for all three.
        qkv = self.c_attn(x).rearrange((..., "qkv", config.Heads, Pos, config.HeadSize))
        q, k, v = hax.unbind(qkv, "qkv")
        if config.upcast_attn:
            q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        if config.scale_attn_by_inverse_layer_idx:
            # The layer's divisor is traced (the layers are scanned), so it goes into the queries:
            # attention takes a constant scale. Keep the query's dtype: a float32 factor would
            # silently upcast low-precision compute.
            q = q * (1.0 / (layer_idx + 1)).astype(q.dtype)
        return q, k, v

    def _attend(self, q: NamedArray, k: NamedArray, v: NamedArray, mask, *, key=None) -> NamedArray:
        """Attention of ``q`` over ``k``/``v`` (on ``key_position``), then the output projection."""
        config = self.config
        attended = dot_product_attention(
            q,
            k,
            v,
            mask,
            Pos=q.resolve_axis(config.Pos.name),
            KeyPos=k.resolve_axis(config.KeyPos.name),
            HeadSize=config.HeadSize,
            scale=1.0 / math.sqrt(config.HeadSize.size),
            backend=config.attn_backend,
            query_block=config.flash_attention_block_size,
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
    def init(config: Gpt2Config, *, key) -> Gpt2Block:
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

    def decode(self, x: NamedArray, layer_idx, cache: KvCache, positions: NamedArray, *, key_len: int):
        attn_out, cache = self.attn.decode(self.ln_1(x), layer_idx, cache, positions, key_len=key_len)
        x = x + attn_out
        return x + self.mlp(self.ln_2(x)), cache


class Gpt2Transformer(eqx.Module):
    """The stack of blocks (scanned over ``layers``, or unrolled without ``scan_layers``) and
    the final LayerNorm: Hugging Face's ``transformer.h`` and ``transformer.ln_f``."""

    config: Gpt2Config = eqx.field(static=True)
    blocks: hnn.Stacked[Gpt2Block]  # hnn.BlockSeq when scan_layers is false
    ln_f: hnn.LayerNorm

    @staticmethod
    def init(config: Gpt2Config, *, key) -> Gpt2Transformer:
        blocks = stack_layers(
            config.Layers,
            Gpt2Block,
            config,
            key=key,
            scan=config.scan_layers,
            gradient_checkpointing=config.gradient_checkpointing,
        )
        return Gpt2Transformer(config, blocks, hnn.LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon))

    def __call__(self, x: NamedArray, attn_mask=None, *, key=None) -> NamedArray:
        # one key per layer, sliced by the scan; None (no dropout) is passed through as is
        keys = jax.random.split(key, self.config.num_layers) if key is not None else None
        x = fold_layers(
            self.blocks, x, hax.arange(self.config.Layers), attn_mask, key=keys, unroll=self.config.unroll_layers
        )
        return self.ln_f(x)

    def decode(self, x: NamedArray, positions: NamedArray, cache: KvCache, *, key_len: int):
        def step(block, carry, layer_idx):
            x, cache = carry
            return block.decode(x, layer_idx.array, cache, positions, key_len=key_len), None

        (x, cache), _ = self.blocks.scan_via(step)((x, cache), hax.arange(self.config.Layers))
        return self.ln_f(x), cache

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"blocks": "h"}


class Gpt2Embeddings(eqx.Module):
    """Token embeddings plus learned absolute position embeddings."""

    config: Gpt2Config = eqx.field(static=True)
    token_embeddings: hnn.Embedding  # (vocab, embed); also the LM head
    position_embeddings: hnn.Embedding  # (position, embed)

    @staticmethod
    def init(Vocab: Axis, config: Gpt2Config, *, key) -> Gpt2Embeddings:
        k_tok, k_pos = jax.random.split(key, 2)
        Embed, std = config.Embed, config.initializer_range
        token = hnn.Embedding(hax.random.normal(k_tok, (Vocab, Embed)) * std, Vocab=Vocab, Embed=Embed)
        position = hnn.Embedding(hax.random.normal(k_pos, (config.Pos, Embed)) * std, Vocab=config.Pos, Embed=Embed)
        return Gpt2Embeddings(config, token, position)

    @property
    def Vocab(self) -> Axis:
        return self.token_embeddings.Vocab

    def __call__(self, input_ids: NamedArray, *, key=None, positions: NamedArray | None = None) -> NamedArray:
        """``positions``: where the tokens sit in their sequences (default ``0..position-1``)."""
        Pos = input_ids.resolve_axis(self.config.Pos.name)
        positions = hax.arange(Pos) if positions is None else positions
        x = self.token_embeddings.embed(input_ids) + self.position_embeddings.embed(positions)
        return _dropout(x, self.config.embed_pdrop, key)

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"token_embeddings": "wte", "position_embeddings": "wpe"}


class Gpt2LMHeadModel(eqx.Module):
    """GPT-2 with its output projection tied to the token embeddings.

    Follows :class:`levanter_core.models.lm.LmHeadModel`: ``input_ids`` is an integer
    array with axes ``(..., position)``; ``key=None`` runs without dropout.
    """

    transformer: Gpt2Transformer
    embeddings: Gpt2Embeddings

    @staticmethod
    def init(Vocab: Axis, config: Gpt2Config, *, key) -> Gpt2LMHeadModel:
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

    def init_cache(self, Batch: Axis, KeyPos: Axis) -> KvCache:
        """An empty key/value cache for decoding (:mod:`levanter_core.inference`)."""
        c = self.config
        like = hax.zeros((c.Heads, c.HeadSize), dtype=self.embeddings.token_embeddings.weight.dtype)
        return KvCache.zeros(c.Layers, Batch, KeyPos, like, like)

    def decode(self, input_ids: NamedArray, positions: NamedArray, cache: KvCache, *, key_len: int):
        """Final hidden states of new tokens ``input_ids`` ``(batch, position)`` at ``positions``,
        attending over the first ``key_len`` positions of ``cache``, and the updated cache."""
        x = self.embeddings(input_ids, positions=positions)
        return self.transformer.decode(x, positions, cache, key_len=key_len)

    def get_lm_head(self) -> NamedArray:
        """The output projection, axes ``(embed, vocab)``: the token embedding matrix."""
        return self.embeddings.token_embeddings.weight.rearrange((self.config.Embed.name, self.Vocab.name))

    def __call__(self, input_ids: NamedArray, *, key=None) -> NamedArray:
        """Logits, axes ``(..., position, vocab)``."""
        hidden = self.activations(input_ids, key=key)
        return hax.dot(hidden, self.get_lm_head(), axis=self.config.Embed.name)

    def _state_dict_key_map(self) -> dict[str, str | None]:
        # Hugging Face keeps the embeddings inside `transformer` (`transformer.wte`, `transformer.wpe`)
        return {"embeddings": "transformer"}
