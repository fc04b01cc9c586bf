"""Multi-head latent attention (MLA; DeepSeek-AI, 2024, DeepSeek-V2 and V3).

Keys and values are not projected from the hidden state directly but from a small latent
(``kv_lora_rank`` wide) that a decoder caches instead of full keys and values:

* queries: ``q_proj`` (or, with ``q_lora_rank``, ``q_b_proj(norm(q_a_proj(x)))``), per head
  ``qk_nope_head_dim`` dimensions without position and ``qk_rope_head_dim`` rotated ones;
* ``kv_a_proj_with_mqa(x)`` gives the latent and one rotated key part shared by all heads
  (``qk_rope_head_dim``); ``kv_b_proj(norm(latent))`` gives each head's unrotated key part
  and its value (``v_head_dim``, which may differ from the key's size);
* attention over ``[nope, rope]`` keys, scaled by ``qk_head_dim ** -0.5`` (times YaRN's
  ``mscale^2`` when the rotary scaling has ``mscale_all_dim``), then ``o_proj``.

With ``rope_interleave`` (DeepSeek-V3's checkpoints), the rotated dimensions come in
interleaved pairs; they are de-interleaved before the usual "rotate half" rotation, as
Hugging Face does. Parameter names are Hugging Face's. The module has
:class:`~levanter_core.layers.attention.Attention`'s three steps (``project``, ``attend``,
``o_proj``), so a key/value cache fits between them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from levanter_core.layers.attention import AttentionBackend, AttentionMask, dot_product_attention
from levanter_core.layers.mlp import init_linear
from levanter_core.layers.norm import RmsNorm
from levanter_core.layers.rotary import RotaryConfig, YarnRotaryConfig, apply_rotary, rotary_tables


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Everything :class:`MultiHeadLatentAttention` needs."""

    Embed: Axis
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope: RotaryConfig | None = None
    """The rotation of the ``qk_rope_head_dim`` part of each query and key (required)."""
    rope_interleave: bool = True
    bias: bool = False
    """Biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (``attention_bias``)."""
    latent_norm_eps: float = 1e-6
    backend: AttentionBackend = "auto"
    query_block: int | None = None
    initializer_range: float = 0.02

    @property
    def Heads(self) -> Axis:
        return Axis("heads", self.num_heads)

    @property
    def QkHead(self) -> Axis:
        return Axis("head_size", self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def VHead(self) -> Axis:
        return Axis("v_head_size", self.v_head_dim)

    @property
    def KvLatent(self) -> Axis:
        return Axis("kv_latent", self.kv_lora_rank)

    @property
    def scale(self) -> float:
        scale: float = self.QkHead.size**-0.5
        rope = self.rope
        if isinstance(rope, YarnRotaryConfig) and rope.mscale_all_dim and rope.factor > 1:
            mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
            scale *= mscale * mscale
        return scale


class MultiHeadLatentAttention(eqx.Module):
    """Multi-head latent attention (see the module docstring)."""

    config: MlaConfig = eqx.field(static=True)
    kv_a_proj_with_mqa: hnn.Linear
    kv_a_layernorm: RmsNorm
    kv_b_proj: hnn.Linear
    o_proj: hnn.Linear
    q_proj: hnn.Linear | None = None
    q_a_proj: hnn.Linear | None = None
    q_a_layernorm: RmsNorm | None = None
    q_b_proj: hnn.Linear | None = None

    @staticmethod
    def init(config: MlaConfig, *, key: jax.Array) -> MultiHeadLatentAttention:
        c = config
        k_q, k_qb, k_kva, k_kvb, k_o = jax.random.split(key, 5)
        std = c.initializer_range
        QOut = (c.Heads, c.QkHead)
        KvA = Axis("kv_latent", c.kv_lora_rank + c.qk_rope_head_dim)
        KvB = (c.Heads, Axis("kv_head", c.qk_nope_head_dim + c.v_head_dim))
        q: dict[str, Any] = {}
        if c.q_lora_rank is None:
            q["q_proj"] = init_linear(c.Embed, QOut, key=k_q, std=std)
        else:
            QLatent = Axis("q_latent", c.q_lora_rank)
            q["q_a_proj"] = init_linear(c.Embed, QLatent, key=k_q, std=std, use_bias=c.bias)
            q["q_a_layernorm"] = RmsNorm.init(QLatent, eps=c.latent_norm_eps)
            q["q_b_proj"] = init_linear(QLatent, QOut, key=k_qb, std=std)
        return MultiHeadLatentAttention(
            c,
            init_linear(c.Embed, KvA, key=k_kva, std=std, use_bias=c.bias),
            RmsNorm.init(c.KvLatent, eps=c.latent_norm_eps),
            init_linear(c.KvLatent, KvB, key=k_kvb, std=std),
            init_linear((c.Heads, c.VHead), c.Embed, key=k_o, std=std, use_bias=c.bias),
            **q,
        )

    def _rotate(self, x: NamedArray, positions: NamedArray, seq_len: int) -> NamedArray:
        """``x``'s ``head_size`` (the rotated part) rotated at ``positions``."""
        c = self.config
        Rope = x.resolve_axis("head_size")
        if c.rope_interleave:  # pairs (0, 1), (2, 3), ... become halves (0, 2, ...), (1, 3, ...)
            order = jnp.concatenate([jnp.arange(0, Rope.size, 2), jnp.arange(1, Rope.size, 2)])
            x = hax.named(jnp.take(x.array, order, axis=x.axis_indices("head_size")), x.axes)
        if c.rope is None:
            raise ValueError("multi-head latent attention rotates part of each head: MlaConfig.rope is required")
        cos, sin = rotary_tables(c.rope, Rope.size, positions, Rope, seq_len=seq_len)
        return apply_rotary(x, cos, sin, Rope)

    def project(
        self,
        x: NamedArray,
        *,
        positions: NamedArray | None = None,
        sliding: jax.Array | NamedArray | None = None,
        seq_len: int | None = None,
    ) -> tuple[NamedArray, NamedArray, NamedArray]:
        """Queries and keys ``(..., position, heads, head_size)`` (``[nope, rope]``, rotated) and
        values ``(..., position, heads, v_head_size)``."""
        c = self.config
        Pos = x.resolve_axis("position")
        positions = hax.arange(Pos) if positions is None else positions
        seq_len = Pos.size if seq_len is None else seq_len
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:  # with q_lora_rank: q_a_proj, q_a_layernorm and q_b_proj
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        nope = c.qk_nope_head_dim
        q_nope = q["head_size", :nope]
        q_rot = self._rotate(q["head_size", nope:], positions, seq_len).rearrange(q_nope.axes)
        q = hax.concatenate("head_size", [q_nope, q_rot])

        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed["kv_latent", : c.kv_lora_rank])
        k_rot = compressed["kv_latent", c.kv_lora_rank :].rename({"kv_latent": "head_size"})
        kv = self.kv_b_proj(latent)
        k_nope = kv["kv_head", :nope].rename({"kv_head": "head_size"})
        v = kv["kv_head", nope:].rename({"kv_head": "v_head_size"})
        # the rotated part is one head's, shared by all
        k_rot = self._rotate(k_rot, positions, seq_len)
        others = tuple(ax for ax in k_nope.axes if ax.name != "head_size")
        k_nope = k_nope.rearrange((*others, "head_size"))
        k_rot = hax.broadcast_to(k_rot, (*others, k_rot.resolve_axis("head_size"))).rearrange((*others, "head_size"))
        k = hax.concatenate("head_size", [k_nope, k_rot])
        return q, k.rearrange(q.axes), v

    def attend(
        self,
        q: NamedArray,
        k: NamedArray,
        v: NamedArray,
        mask: AttentionMask,
        *,
        sliding: jax.Array | NamedArray | None = None,
    ) -> NamedArray:
        """Attention of ``q`` (on ``position``) over ``k``/``v`` (on ``key_position``), before ``o_proj``."""
        c = self.config
        # every head is its own key/value head: the grouped layout's two head axes, one of size 1
        group = {"heads": "kv_heads"}
        q = q.rename(group).broadcast_axis(Axis("q_heads_per_group", 1))
        out = dot_product_attention(
            q,
            k.rename(group),
            v.rename(group),
            mask,
            Pos=q.resolve_axis("position"),
            KeyPos=k.resolve_axis("key_position"),
            HeadSize=c.QkHead,
            VHeadSize=c.VHead,
            scale=c.scale,
            backend=c.backend,
            query_block=c.query_block,
        )
        return out["q_heads_per_group", 0].rename({"kv_heads": "heads"})

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask,
        *,
        sliding: jax.Array | NamedArray | None = None,
        positions: NamedArray | None = None,
        key: jax.Array | None = None,
    ) -> NamedArray:
        q, k, v = self.project(x, positions=positions)
        renamed = {"position": "key_position"}
        return self.o_proj(self.attend(q, k.rename(renamed), v.rename(renamed), mask))
