"""Self-attention for decoder-only models: masks, the attention computation, and the
attention layer most architectures share.

Axes: queries have ``(..., position, kv_heads, q_heads_per_group, head_size)`` and keys
and values ``(..., key_position, kv_heads, head_size)``. Grouped-query attention is
these two head axes: each of the ``kv_heads`` key/value heads serves
``q_heads_per_group`` query heads. Multi-head attention has one query head per group,
multi-query attention one key/value head. Flattened, query head ``n`` belongs to
key/value head ``n // q_heads_per_group``, the layout of Hugging Face checkpoints.

Two implementations compute the same thing (``attn_backend``):

* ``reference``: plain named-axis einsums and a float32 softmax, readable and exact.
  Causal attention runs in blocks of ``QUERY_BLOCK`` queries, each over the keys up to
  its last query only, which skips most of the masked upper triangle;
* ``jax``: :func:`jax.nn.dot_product_attention`, asked for cuDNN's fused flash attention on
  NVIDIA GPUs (bfloat16/float16 causal attention; :func:`fused_implementation`) and XLA's
  kernel elsewhere;
* ``auto`` (the default) picks ``jax`` on GPU and ``reference`` elsewhere, and always
  ``reference`` when the model soft-caps attention logits (``jax`` cannot).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Annotated, Literal

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray
from haliax.state_dict import ModuleWithStateDictSerialization, StateDict
from pydantic import BeforeValidator

from levanter_core.hf.layouts import fuse, unfuse
from levanter_core.layers.context_parallel import context_mesh_axis, context_parallel_attention
from levanter_core.layers.mlp import init_linear
from levanter_core.layers.norm import RmsNorm
from levanter_core.layers.rotary import RotaryConfig, apply_rotary, rotary_tables

_LEVANTER_BACKENDS = {
    None: "auto",
    "default": "auto",
    "jax_flash": "auto",
    "splash": "auto",
    "nvte": "jax",
    "vanilla": "reference",
}
"""Levanter's ``attn_backend`` names and what they mean here: ``default`` (and null) let the
hardware decide; ``jax_flash`` (blockwise flash attention written in JAX) and ``splash`` (TPU's
fused kernel) ask for memory-efficient attention, which ``auto`` gives (cuDNN's fused kernel on
GPU, causal query blocks elsewhere); ``nvte`` (Transformer Engine's fused kernel) is cuDNN's
fused attention, ``jax``; ``vanilla`` is the plain computation, ``reference``."""


def _backend_from_levanter(value: object) -> object:
    if value is None or (isinstance(value, str) and value.lower() in _LEVANTER_BACKENDS):
        return _LEVANTER_BACKENDS[value.lower() if isinstance(value, str) else None]
    return value


AttentionBackend = Annotated[Literal["auto", "reference", "jax"], BeforeValidator(_backend_from_levanter)]
"""``auto``, ``reference`` or ``jax`` (see the module docstring). Levanter's names are accepted
too: ``default``/null and ``jax_flash``/``splash`` mean ``auto``, ``nvte`` means ``jax``,
``vanilla`` means ``reference``."""

QUERY_BLOCK = 128
"""Queries per block of causal attention in the ``reference`` backend. A block attends to the
keys up to its last query, so 256 positions take 3/4 of the work of the full square, 2,048
positions 9/16. (The reference GPT-2, seq_len 256 on 2 CPU cores: 6% faster per step than
one block; blocks of 64 were no faster than 128, and 32 slower.)"""


class AttentionMask(eqx.Module):
    """Which keys each query may attend to: causal, optionally restricted to the query's own
    segment (several documents packed into one sequence) and to a sliding window.

    ``segment_ids`` has axes ``(..., position)``: a query attends only to keys with the
    same id. The window is applied per layer (see :meth:`materialize`).
    """

    segment_ids: NamedArray | None = None
    causal: bool = eqx.field(static=True, default=True)
    query_positions: NamedArray | None = None
    """Where each query sits in its sequence, ``(..., position)``, when the queries are not the
    keys' first positions (decoding with a key/value cache: the keys are the whole sequence so
    far, indexed by position, the queries its newest tokens). None: query ``i`` is at ``i``."""

    @staticmethod
    def causal_mask() -> AttentionMask:
        return AttentionMask()

    def with_segments(self, segment_ids: NamedArray) -> AttentionMask:
        return dataclasses.replace(self, segment_ids=segment_ids)

    def at_positions(self, positions: NamedArray) -> AttentionMask:
        """This mask for queries at ``positions`` (``(..., position)``) over keys indexed by position."""
        return dataclasses.replace(self, query_positions=positions)

    def materialize(
        self, Pos: Axis, KeyPos: Axis, *, window: int | None = None, sliding: jax.Array | NamedArray | None = None
    ) -> NamedArray:
        """A boolean array ``(..., position, key_position)``, True where attention is allowed.

        ``window``: a query at ``q`` sees keys ``q - window < k <= q`` (``window`` keys,
        itself included), as Hugging Face's sliding-window models do. ``sliding`` (a
        traced boolean, for layers scanned together) switches the window on or off."""
        if self.query_positions is None:
            q = hax.broadcast_to(hax.arange(Pos), (Pos, KeyPos))
        else:
            batch = tuple(ax for ax in self.query_positions.axes if ax.name != Pos.name)
            q = hax.broadcast_to(self.query_positions, (*batch, Pos, KeyPos))
        k = hax.broadcast_to(hax.arange(KeyPos), (Pos, KeyPos))
        allowed = hax.full((Pos, KeyPos), True, dtype=jnp.bool_)
        if self.causal:
            allowed = allowed & (k <= q)
        if window is not None:
            in_window = k > q - window
            if sliding is not None:
                in_window = in_window | ~_scalar(sliding)
            allowed = allowed & in_window
        if self.segment_ids is not None:
            batch = tuple(ax for ax in self.segment_ids.axes if ax.name != Pos.name)
            q_seg = hax.broadcast_to(self.segment_ids, (*batch, Pos, KeyPos))
            k_seg = hax.broadcast_to(self.segment_ids.rename({Pos.name: KeyPos.name}), (*batch, Pos, KeyPos))
            allowed = allowed & (q_seg == k_seg)
        return allowed


def _scalar(x: jax.Array | NamedArray | bool) -> jax.Array:
    return x.array if isinstance(x, NamedArray) else jnp.asarray(x)


def resolve_backend(
    backend: AttentionBackend, *, soft_cap: float | None, dropout: bool = False, sinks: bool = False
) -> Literal["reference", "jax"]:
    """The implementation to run: ``jax`` can neither soft-cap the logits, nor drop out
    weights, nor add attention sinks."""
    unsupported_features = (
        (soft_cap is not None, "soft-cap attention logits"),
        (dropout, "drop out attention weights"),
        (sinks, "add attention sinks"),
    )
    for unsupported, what in unsupported_features:
        if backend == "jax" and unsupported:
            raise ValueError(f"attn_backend 'jax' cannot {what}; use 'reference' or 'auto'")
    if backend == "auto":
        plain = soft_cap is None and not dropout and not sinks
        return "jax" if jax.default_backend() == "gpu" and plain else "reference"
    return backend


def dot_product_attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    mask: AttentionMask,
    *,
    Pos: Axis,
    KeyPos: Axis,
    HeadSize: Axis,
    scale: float,
    soft_cap: float | None = None,
    window: int | None = None,
    sliding: jax.Array | NamedArray | None = None,
    backend: AttentionBackend = "auto",
    dropout: float = 0.0,
    key: jax.Array | None = None,
    query_block: int | None = None,
    upcast: bool = False,
    sinks: NamedArray | None = None,
    VHeadSize: Axis | None = None,
) -> NamedArray:
    """Attention of ``q`` over ``k``/``v`` (axes as in the module docstring).

    ``scale`` multiplies the query-key products; ``soft_cap`` applies
    ``soft_cap * tanh(scores / soft_cap)`` before masking (Gemma 2). The softmax runs in
    float32; the result has ``q``'s axes and dtype. ``dropout`` is the probability of dropping
    each attention weight, in training only (when a ``key`` is given). ``query_block``: queries
    per block of causal attention (default ``QUERY_BLOCK``; the models' ``flash_attention_block_size``).
    ``upcast``: compute the query-key products in float32 too, not only the softmax (Levanter's
    ``upcast_attn``). ``sinks``: one learned logit per query head (axes ``(kv_heads,
    q_heads_per_group)``) that joins every softmax as an extra key with no value, so a head
    can attend to nothing (GPT-OSS's attention sinks). ``VHeadSize``: the values' head axis when
    it differs from the queries' and keys' (multi-head latent attention); the result has it in
    place of ``HeadSize`` (``reference`` backend only)."""
    dropout = dropout if key is not None else 0.0
    block_size = query_block or QUERY_BLOCK
    if VHeadSize is not None and VHeadSize != HeadSize:
        backend = "reference" if backend == "auto" else backend
        if backend != "reference":
            raise ValueError("values with a head size of their own need attn_backend 'reference' or 'auto'")
    VHead = VHeadSize or HeadSize
    mesh_axis = context_mesh_axis(Pos)
    if mesh_axis is not None and mask.query_positions is None and Pos.size == KeyPos.size:
        if dropout > 0:
            raise ValueError(
                "attention dropout is not available with context parallelism (position split over devices)"
            )
        if upcast:
            q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        out = context_parallel_attention(
            q, k, v, mesh_axis=mesh_axis, Pos=Pos, KeyPos=KeyPos, HeadSize=HeadSize, VHead=VHead, scale=scale,
            causal=mask.causal, segment_ids=mask.segment_ids, soft_cap=soft_cap, window=window,
            sliding=_scalar(sliding) if sliding is not None else None, sinks=sinks, key_block=query_block,
        )  # fmt: skip
        return out.rearrange(tuple(VHead if ax.name == HeadSize.name else ax for ax in q.axes)).astype(v.dtype)
    if resolve_backend(backend, soft_cap=soft_cap, dropout=dropout > 0, sinks=sinks is not None) == "jax":
        return _jax_attention(q, k, v, mask, Pos, KeyPos, HeadSize, scale, window, sliding)
    if upcast:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    allowed = mask.materialize(Pos, KeyPos, window=window, sliding=sliding)
    axes = tuple(VHead if ax.name == HeadSize.name else ax for ax in q.axes)
    # Heads before positions: the einsums below then need no transposes between them.
    q = q.rearrange((..., Pos, HeadSize))
    k, v = k.rearrange((..., KeyPos, HeadSize)), v.rearrange((..., KeyPos, VHead))
    q_scale = jnp.asarray(scale, q.dtype)
    causal_self = mask.causal and Pos.size == KeyPos.size and mask.query_positions is None
    starts = range(0, Pos.size, block_size) if causal_self else [0]
    keys_per_block = jax.random.split(key, len(starts)) if dropout > 0 and key is not None else [None] * len(starts)
    blocks = []
    for start, block_key in zip(starts, keys_per_block):
        end = min(start + block_size, Pos.size) if causal_self else Pos.size
        keys = end if causal_self else KeyPos.size  # a causal block sees no key after its last query
        blocks.append(
            _attend(
                q[Pos.name, start:end] * q_scale,
                k[KeyPos.name, :keys],
                v[KeyPos.name, :keys],
                allowed[Pos.name, start:end, KeyPos.name, :keys],
                KeyPos=KeyPos.resize(keys),
                HeadSize=HeadSize,
                soft_cap=soft_cap,
                dropout=dropout,
                key=block_key,
                sinks=sinks,
            )
        )
    out = blocks[0] if len(blocks) == 1 else hax.concatenate(Pos.name, blocks)
    return out.rearrange(axes).astype(v.dtype)


def _attend(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    allowed: NamedArray,
    *,
    KeyPos: Axis,
    HeadSize: Axis,
    soft_cap: float | None,
    dropout: float,
    key: jax.Array | None,
    sinks: NamedArray | None = None,
) -> NamedArray:
    """Softmax attention of the (already scaled) queries ``q`` over ``k``/``v``, where ``allowed``,
    dropping each weight with probability ``dropout`` (with ``key``; None: none dropped), with
    ``sinks`` (per query head) as one more logit in each softmax."""
    scores = hax.dot(q, k, axis=HeadSize)
    if soft_cap is not None:
        scores = hax.tanh(scores / soft_cap) * soft_cap
    scores = hax.where(allowed, scores.astype(jnp.float32), np.finfo(np.float32).min)
    if sinks is None:
        weights = hnn.softmax(scores, axis=KeyPos).astype(v.dtype)
    else:
        sink = sinks.astype(jnp.float32)
        top = hax.maximum(hax.max(scores, axis=KeyPos), sink)
        exp = hax.exp(scores - top)
        weights = (exp / (hax.sum(exp, axis=KeyPos) + hax.exp(sink - top))).astype(v.dtype)
    if dropout > 0:
        weights = hnn.dropout(weights, dropout, inference=False, key=key)
    return hax.dot(weights, v, axis=KeyPos)


def fused_implementation(platform: str, dtype: jnp.dtype, head_size: int) -> Literal["cudnn"] | None:
    """What ``jax.nn.dot_product_attention`` should run: ``cudnn`` (the fused flash-attention
    kernel) on an NVIDIA GPU for 16-bit inputs with a head size it takes, else None (XLA's
    kernel, which materializes the scores). jax's own default, None, is XLA's kernel everywhere,
    the GPU included, so the fused kernel must be asked for."""
    fused_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if platform in ("gpu", "cuda") and fused_dtype and head_size % 8 == 0 and head_size <= 256:
        return "cudnn"
    return None


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def _jax_attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    mask: AttentionMask,
    Pos: Axis,
    KeyPos: Axis,
    HeadSize: Axis,
    scale: float,
    window: int | None,
    sliding: jax.Array | NamedArray | None,
) -> NamedArray:
    """The same computation through :func:`jax.nn.dot_product_attention` ([B, T, N, H] layout).
    Queries grouped as ``(kv_heads, q_heads_per_group)``, or one query head per key head on a
    ``heads`` axis (GPT-2's multi-head attention)."""
    if "kv_heads" not in [ax.name for ax in k.axes]:
        Heads = k.resolve_axis("heads")
        KvHeads, One = Heads.alias("kv_heads"), Axis("q_heads_per_group", 1)
        grouped = _jax_attention(
            q.rename({Heads.name: KvHeads.name}).broadcast_axis(One),
            k.rename({Heads.name: KvHeads.name}),
            v.rename({Heads.name: KvHeads.name}),
            mask, Pos, KeyPos, HeadSize, scale, window, sliding,
        )  # fmt: skip
        return grouped[One.name, 0].rename({KvHeads.name: Heads.name}).rearrange(q.axes)
    KvHeads = k.resolve_axis("kv_heads")
    QPerGroup = q.resolve_axis("q_heads_per_group")
    batch_axes = tuple(ax for ax in q.axes if ax.name not in (Pos.name, KvHeads.name, QPerGroup.name, HeadSize.name))
    batch = math.prod(ax.size for ax in batch_axes)
    q_arr = q.rearrange((*batch_axes, Pos, KvHeads, QPerGroup, HeadSize)).array
    q_arr = q_arr.reshape(batch, Pos.size, KvHeads.size * QPerGroup.size, HeadSize.size)
    k_arr = k.rearrange((*batch_axes, KeyPos, KvHeads, HeadSize)).array.reshape(batch, KeyPos.size, KvHeads.size, -1)
    v_arr = v.rearrange((*batch_axes, KeyPos, KvHeads, HeadSize)).array.reshape(batch, KeyPos.size, KvHeads.size, -1)

    # a window fixed for the layer (not switched by a traced `sliding`), as cuDNN takes it
    static_window = (window - 1, 0) if window is not None and sliding is None else None
    plain = mask.segment_ids is None and mask.query_positions is None and Pos.size == KeyPos.size
    if plain and mask.causal and (window is None or static_window is not None):
        # the pattern cuDNN's fused kernel knows: causal, optionally a fixed window
        def causal(implementation: Literal["cudnn"] | None) -> jax.Array:
            return jax.nn.dot_product_attention(
                q_arr,
                k_arr,
                v_arr,
                scale=scale,
                is_causal=True,
                local_window_size=static_window,
                implementation=implementation,
            )

        implementation = fused_implementation(jax.default_backend(), q_arr.dtype, HeadSize.size)
        try:
            out = causal(implementation)
        except (NotImplementedError, RuntimeError, ValueError) as e:
            if implementation is None:
                raise
            # a cuDNN too old for this head size or GPU: XLA's kernel computes the same thing
            _warn_once(f"cuDNN's fused attention is not available here ({e}); attention runs as XLA's kernel")
            out = causal(None)
    else:
        allowed = mask.materialize(Pos, KeyPos, window=window, sliding=sliding)
        allowed = allowed.broadcast_to((*batch_axes, Pos, KeyPos)).rearrange((*batch_axes, Pos, KeyPos))
        allowed = allowed.array.reshape(batch, 1, Pos.size, KeyPos.size)
        out = jax.nn.dot_product_attention(q_arr, k_arr, v_arr, mask=allowed, scale=scale)
    out = out.reshape(*(ax.size for ax in batch_axes), Pos.size, KvHeads.size, QPerGroup.size, HeadSize.size)
    return hax.named(out, (*batch_axes, Pos, KvHeads, QPerGroup, HeadSize)).rearrange(q.axes)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Everything :class:`Attention` needs; a model config derives one from its own fields."""

    Embed: Axis
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RotaryConfig | None = None
    """A rotary config from :mod:`levanter_core.layers.rotary`, or None for no rotary embedding.
    Its ``partial_rotary_factor`` rotates only the first part of each head."""
    local_rope: RotaryConfig | None = None
    """Rotary config for sliding-window layers when it differs from ``rope`` (Gemma 3, OLMo 3):
    used where the layer's ``sliding`` switch is on, or everywhere when there is no switch and
    ``sliding_window`` is set."""
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: Literal["none", "head", "all_heads"] = "none"
    """RMSNorm of queries and keys before the rotation: per head over ``head_size`` (Qwen 3,
    Gemma 3), or over all heads together (OLMo 2)."""
    qk_norm_eps: float = 1e-6
    qk_norm_offset: float = 0.0
    scale: float | None = None
    """Multiplier of the query-key products; default ``head_dim ** -0.5``."""
    logits_soft_cap: float | None = None
    sliding_window: int | None = None
    backend: AttentionBackend = "auto"
    query_block: int | None = None
    """Queries per block of causal attention (``flash_attention_block_size``); None: ``QUERY_BLOCK``."""
    upcast: bool = False
    """Compute the query-key products in float32 (``upcast_attn``); the softmax always is."""
    initializer_range: float = 0.02
    out_std: float | None = None
    """Standard deviation of ``o_proj``'s initialization; default ``initializer_range``."""
    sinks: bool = False
    """A learned logit per query head that joins every softmax (GPT-OSS), stored as ``sinks``."""
    hf_fused_qkv: str | None = None
    """The name under which Hugging Face checkpoints store the query, key and value projections
    as one tensor (Phi-3's ``qkv_proj``); None: three tensors, ``q_proj``, ``k_proj``, ``v_proj``."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def Heads(self) -> Axis:
        """All query heads, flattened (the layout of per-head parameters such as ``sinks``)."""
        return Axis("heads", self.num_heads)

    @property
    def KvHeads(self) -> Axis:
        return Axis("kv_heads", self.num_kv_heads)

    @property
    def QHeadsPerGroup(self) -> Axis:
        return Axis("q_heads_per_group", self.num_heads // self.num_kv_heads)

    @property
    def HeadSize(self) -> Axis:
        return Axis("head_size", self.head_dim)


class Attention(ModuleWithStateDictSerialization):
    """Multi-head, grouped-query or multi-query self-attention with Hugging Face's parameter
    names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``, ``sinks``).

    Three steps, each a method, so that a key/value cache can sit between them:
    :meth:`project` (queries, keys and values, normalized and rotated at their positions),
    :meth:`attend` (queries over whatever keys and values are given, on ``key_position``),
    and ``o_proj``. ``__call__`` runs the three over one sequence."""

    config: AttentionConfig = eqx.field(static=True)
    q_proj: hnn.Linear
    k_proj: hnn.Linear
    v_proj: hnn.Linear
    o_proj: hnn.Linear
    q_norm: RmsNorm | None = None
    k_norm: RmsNorm | None = None
    sinks: NamedArray | None = None

    @staticmethod
    def init(config: AttentionConfig, *, key: jax.Array) -> Attention:
        k_q, k_k, k_v, k_o = jax.random.split(key, 4)
        c = config
        QOut = (c.KvHeads, c.QHeadsPerGroup, c.HeadSize)
        KvOut = (c.KvHeads, c.HeadSize)
        std = c.initializer_range
        q_proj = init_linear(c.Embed, QOut, key=k_q, std=std, use_bias=c.qkv_bias)
        k_proj = init_linear(c.Embed, KvOut, key=k_k, std=std, use_bias=c.qkv_bias)
        v_proj = init_linear(c.Embed, KvOut, key=k_v, std=std, use_bias=c.qkv_bias)
        o_proj = init_linear(QOut, c.Embed, key=k_o, std=c.out_std or std, use_bias=c.out_bias)
        q_norm = k_norm = None
        if c.qk_norm != "none":
            q_axes, k_axes = (c.HeadSize, c.HeadSize) if c.qk_norm == "head" else (QOut, KvOut)
            q_norm = RmsNorm.init(q_axes, eps=c.qk_norm_eps, weight_offset=c.qk_norm_offset)
            k_norm = RmsNorm.init(k_axes, eps=c.qk_norm_eps, weight_offset=c.qk_norm_offset)
        # its own key, so that adding sinks leaves the projections' initialization as it was
        sinks = hax.random.normal(jax.random.fold_in(key, 4), c.Heads) * std if c.sinks else None
        return Attention(config, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, sinks)

    def project(
        self,
        x: NamedArray,
        *,
        positions: NamedArray | None = None,
        sliding: jax.Array | NamedArray | None = None,
        seq_len: int | None = None,
    ) -> tuple[NamedArray, NamedArray, NamedArray]:
        """Queries ``(..., position, kv_heads, q_heads_per_group, head_size)`` and keys and
        values ``(..., position, kv_heads, head_size)`` of ``x`` ``(..., position, embed)``,
        normalized and rotated. ``positions`` (default ``0..position-1``) are where the tokens
        sit in their sequence; ``seq_len`` (default the ``position`` axis' size) is that
        sequence's length, for rotary scalings that depend on it."""
        c = self.config
        Pos = x.resolve_axis("position")
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if c.rope is not None:
            positions = hax.arange(Pos) if positions is None else positions
            seq_len = Pos.size if seq_len is None else seq_len
            cos, sin = rotary_tables(c.rope, c.head_dim, positions, c.HeadSize, seq_len=seq_len)
            if c.local_rope is not None and sliding is not None:
                local_cos, local_sin = rotary_tables(c.local_rope, c.head_dim, positions, c.HeadSize, seq_len=seq_len)
                on = _scalar(sliding)
                cos, sin = hax.where(on, local_cos, cos), hax.where(on, local_sin, sin)
            elif c.local_rope is not None and c.sliding_window is not None:
                # every layer slides (no per-layer switch): all of them rotate as sliding layers
                cos, sin = rotary_tables(c.local_rope, c.head_dim, positions, c.HeadSize, seq_len=seq_len)
            q = apply_rotary(q, cos, sin, c.HeadSize)
            k = apply_rotary(k, cos, sin, c.HeadSize)
        return q, k, v

    def attend(
        self,
        q: NamedArray,
        k: NamedArray,
        v: NamedArray,
        mask: AttentionMask,
        *,
        sliding: jax.Array | NamedArray | None = None,
    ) -> NamedArray:
        """Attention of ``q`` (on ``position``) over ``k``/``v`` (on ``key_position``), before
        the output projection. ``sliding`` (a boolean scalar, possibly traced) says whether
        this layer uses the sliding window; None means it does when the config has one."""
        c = self.config
        sinks = None
        if self.sinks is not None:
            sinks = hax.named(self.sinks.array.reshape(c.num_kv_heads, -1), (c.KvHeads, c.QHeadsPerGroup))
        return dot_product_attention(
            q,
            k,
            v,
            mask,
            Pos=q.resolve_axis("position"),
            KeyPos=k.resolve_axis("key_position"),
            HeadSize=c.HeadSize,
            scale=c.scale if c.scale is not None else c.head_dim**-0.5,
            soft_cap=c.logits_soft_cap,
            window=c.sliding_window,
            sliding=sliding,
            backend=c.backend,
            query_block=c.query_block,
            upcast=c.upcast,
            sinks=sinks,
        )

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask,
        *,
        sliding: jax.Array | NamedArray | None = None,
        positions: NamedArray | None = None,
        key: jax.Array | None = None,
    ) -> NamedArray:
        """``x`` has axes ``(..., position, embed)``. ``sliding`` (a boolean scalar, possibly
        traced) says whether this layer uses the sliding window; None means it does when
        the config has one. ``positions`` (default ``0..position-1``) feed the rotation."""
        q, k, v = self.project(x, positions=positions, sliding=sliding)
        renamed = {"position": "key_position"}
        attended = self.attend(q, k.rename(renamed), v.rename(renamed), mask, sliding=sliding)
        return self.o_proj(attended)

    # -- Hugging Face layout: the projections fused into one tensor when the family does -------
    def to_state_dict(self, prefix: str | None = None) -> StateDict:
        state = super().to_state_dict(prefix)
        fused = self.config.hf_fused_qkv
        return state if fused is None else fuse(state, prefix, ("q_proj", "k_proj", "v_proj"), fused)

    def from_state_dict(self, state_dict: StateDict, prefix: str | None = None) -> Attention:
        c = self.config
        if c.hf_fused_qkv is not None:
            q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            parts = (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows))
            state_dict = unfuse(state_dict, prefix, parts, c.hf_fused_qkv)
        loaded: Attention = super().from_state_dict(state_dict, prefix)
        return loaded
