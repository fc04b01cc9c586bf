"""Context parallelism: attention over sequences whose positions are split over devices.

When the compute mapping splits the ``position`` axis over a mesh axis (``trainer.mesh``:
``axes: {context: N}`` with ``shared_mapping: {position: context}``), every layer except
attention is local to a position, so the rest of the model runs on each device's slice of each
sequence as it is (XLA partitions it). Attention needs every earlier key of its sequence, and
:func:`context_parallel_attention` computes it in one of two ways (``trainer.context_attention``):

* ``ring``: each device keeps its queries and passes its keys and values around the ring of the
  ``N`` devices (``ppermute``), combining the ``N`` blocks of scores by the online softmax of
  flash attention (a running maximum, sum of weights and weighted sum of values per query).
  Each device holds two blocks of keys and values at a time; the step's activation memory for
  attention is ``1/N`` of one device's.
* ``all_gather``: each device gathers the whole sequence's keys and values (``all_gather``) and
  attends its own queries over them: one round of communication instead of ``N - 1``, at the
  cost of every device holding all keys and values of a layer during its attention (Levanter's
  way: its ``key_position`` is not split).

Causal attention gives the early positions of a sequence less work than the late ones, so both
lay the queries out *zigzag* first: the sequence is cut into ``2N`` chunks, and device ``i``
attends for chunks ``i`` and ``2N - 1 - i`` (one early, one late), which gives every device the
same number of allowed query-key pairs. The chunks move by two ``ppermute`` s in and two out.
Masks use each token's position in the sequence, so causality, packed documents (segment ids),
sliding windows, attention sinks, grouped-query and latent attention (values with a head size
of their own) mean what they mean on one device; rotary embeddings are applied before attention,
at the tokens' own positions, so they need nothing here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray
from jax.sharding import PartitionSpec

from levanter_core.config.types import ContextAttention

_STRATEGY: contextvars.ContextVar[ContextAttention] = contextvars.ContextVar("context_attention", default="ring")
_NEG = float(np.finfo(np.float32).min)


@contextlib.contextmanager
def context_attention(strategy: ContextAttention) -> Iterator[None]:
    """Compute context-parallel attention by ``strategy`` while tracing inside this block (the
    trainer enters it around its steps, from ``trainer.context_attention``)."""
    token = _STRATEGY.set(strategy)
    try:
        yield
    finally:
        _STRATEGY.reset(token)


KEY_BLOCK = 512
"""Keys per block of context-parallel attention when the model does not say
(``flash_attention_block_size``)."""


def split_mesh_axis(name: str, kind: str) -> str | None:
    """The mesh axis the current compute mapping splits the logical axis ``name`` over, when it
    splits it over more than one device; None otherwise. ``kind`` (``context parallelism``...)
    splits over one mesh axis: a mapping onto several is a ``ValueError``."""
    mapping = hax.partitioning.current_thread_local_mapping()
    physical = mapping.get(name) if mapping else None
    if physical is None:
        return None
    names = [physical] if isinstance(physical, str) else list(physical)
    if len(names) != 1:
        raise ValueError(f"the {name} axis is mapped to {names}; {kind} splits it over one mesh axis")
    mesh = hax.partitioning._resolve_mesh()
    if mesh is None or mesh.shape.get(names[0], 1) == 1:
        return None
    return names[0]


def context_mesh_axis(Pos: Axis) -> str | None:
    """The mesh axis the current compute mapping splits ``Pos`` over, when it splits it over
    more than one device; None otherwise (attention then runs as on one device)."""
    return split_mesh_axis(Pos.name, "context parallelism")


def context_parallel_attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    *,
    mesh_axis: str,
    Pos: Axis,
    KeyPos: Axis,
    HeadSize: Axis,
    VHead: Axis,
    scale: float,
    causal: bool,
    segment_ids: NamedArray | None,
    soft_cap: float | None,
    window: int | None,
    sliding: jax.Array | None,
    sinks: NamedArray | None,
    strategy: ContextAttention | None = None,
    key_block: int | None = None,
) -> NamedArray:
    """Attention of ``q`` over ``k``/``v`` (axes as in :mod:`levanter_core.layers.attention`) with
    ``Pos`` and ``KeyPos`` (the same positions) split over ``mesh_axis``. Every query and key sits
    at its index in the sequence; ``segment_ids`` ``(..., position)`` keep packed documents apart.
    ``key_block``: a device's queries meet the keys it holds or receives this many at a time
    (the models' ``flash_attention_block_size``; None: :data:`KEY_BLOCK`), so that its scores
    take ``S/N x key_block`` at a time, not ``S/N x S/N``. The result has ``q``'s axes with
    ``VHead`` for ``HeadSize``, and ``q``'s dtype (the softmax and the sums run in float32)."""
    strategy = strategy or _STRATEGY.get()
    mesh = hax.partitioning._resolve_mesh()
    n = mesh.shape[mesh_axis]
    if Pos.size != KeyPos.size or Pos.size % (2 * n):
        raise ValueError(
            f"context parallelism over {n} devices splits each sequence into {2 * n} equal chunks; "
            f"{Pos.size} positions do not divide (train on a multiple of {2 * n})"
        )
    # Arrays laid out (others..., position, head): the position dim is the one before last.
    q = q.rearrange((..., Pos, HeadSize))
    k = k.rearrange((..., KeyPos, HeadSize))
    v = v.rearrange((..., KeyPos, VHead))
    out_axes = (*q.axes[:-1], VHead)
    spec_q = _spec(q.axes, Pos.name, mesh_axis)
    spec_k = _spec(k.axes, KeyPos.name, mesh_axis)
    spec_v = _spec(v.axes, KeyPos.name, mesh_axis)
    if segment_ids is None:
        seg = jnp.zeros((Pos.size,), jnp.int32)
        seg_axes: tuple[Axis, ...] = (Pos,)
    else:
        segment_ids = segment_ids.rearrange((..., Pos))
        seg, seg_axes = segment_ids.array, segment_ids.axes
    spec_seg = _spec(seg_axes, Pos.name, mesh_axis)
    has_sinks = sinks is not None
    sink_arr = sinks.array if sinks is not None else jnp.zeros(())
    sink_axes = sinks.axes if sinks is not None else ()
    sliding_arr = jnp.asarray(True if sliding is None else sliding)
    names = {
        "q": tuple(ax.name for ax in q.axes),
        "k": tuple(ax.name for ax in k.axes),
        "v": tuple(ax.name for ax in v.axes),
        "seg": tuple(ax.name for ax in seg_axes),
        "sinks": tuple(ax.name for ax in sink_axes),
    }
    body = functools.partial(
        _local_attention,
        names=names,
        mesh_axis=mesh_axis,
        n=n,
        strategy=strategy,
        pos=Pos.name,
        key_pos=KeyPos.name,
        head=HeadSize.name,
        scale=scale,
        causal=causal,
        soft_cap=soft_cap,
        window=window,
        has_sinks=has_sinks,
        key_block=key_block or KEY_BLOCK,
    )
    sink_spec = _spec(sink_axes, None, None) if has_sinks else PartitionSpec()
    out = jax.shard_map(
        without_mapping(body),
        mesh=mesh,
        in_specs=(spec_q, spec_k, spec_v, spec_seg, sink_spec, PartitionSpec()),
        out_specs=spec_q,
        check_vma=False,
    )(q.array, k.array, v.array, seg, sink_arr, sliding_arr)
    return hax.named(out, out_axes)


def without_mapping(fn):
    """``fn`` run with no axis mapping: inside ``shard_map`` the arrays are each device's own,
    and the named operations must not ask for shardings of the whole. No mapping at all (not
    an empty one, whose constraints a ``vmap`` around the ``shard_map``, a pipeline's over its
    stages, would turn into constraints on the stage axis, which is manual there)."""

    @functools.wraps(fn)
    def wrapped(*args):
        holder = hax.partitioning._mapping_holder.thread_data
        before = getattr(holder, "resource_mapping", None)
        holder.resource_mapping = None
        try:
            return fn(*args)
        finally:
            holder.resource_mapping = before

    return wrapped


def _spec(axes: tuple[Axis, ...], pos: str | None, mesh_axis: str | None) -> PartitionSpec:
    """The partition spec of ``axes`` under the current compute mapping, with ``pos`` on ``mesh_axis``."""
    mapping = dict(hax.partitioning.current_thread_local_mapping() or {})
    return PartitionSpec(*(mesh_axis if ax.name == pos else mapping.get(ax.name) for ax in axes))


def _zigzag_destinations(n: int) -> list[int]:
    """Where each of the ``2n`` chunks goes in the zigzag layout: chunk ``j`` (on device ``j // 2``
    in order) to device ``j`` if ``j < n``, else ``2n - 1 - j``."""
    return [j if j < n else 2 * n - 1 - j for j in range(2 * n)]


def _zigzag(x: jax.Array, dim: int, axis: str, n: int) -> jax.Array:
    """This device's two chunks of a dimension laid out in order (device ``d`` holds chunks
    ``2d`` and ``2d + 1`` of ``2n``) moved to the zigzag layout (device ``i`` holds chunks ``i``
    and ``2n - 1 - i``): two ``ppermute`` s, one per chunk."""
    first, second = jnp.split(x, 2, axis=dim)
    dest = _zigzag_destinations(n)
    even = jax.lax.ppermute(first, axis, [(d, dest[2 * d]) for d in range(n)])
    odd = jax.lax.ppermute(second, axis, [(d, dest[2 * d + 1]) for d in range(n)])
    # device i receives chunk i and chunk 2n - 1 - i, of opposite parities
    i_even = jax.lax.axis_index(axis) % 2 == 0
    return jnp.concatenate([jnp.where(i_even, even, odd), jnp.where(i_even, odd, even)], axis=dim)


def _unzigzag(x: jax.Array, dim: int, axis: str, n: int) -> jax.Array:
    """The inverse of :func:`_zigzag`."""
    low, high = jnp.split(x, 2, axis=dim)  # chunks i and 2n - 1 - i
    i_even = jax.lax.axis_index(axis) % 2 == 0
    even, odd = jnp.where(i_even, low, high), jnp.where(i_even, high, low)
    dest = _zigzag_destinations(n)
    first = jax.lax.ppermute(even, axis, [(dest[2 * d], d) for d in range(n)])
    second = jax.lax.ppermute(odd, axis, [(dest[2 * d + 1], d) for d in range(n)])
    return jnp.concatenate([first, second], axis=dim)


def _zigzag_positions(axis: str, n: int, local: int) -> jax.Array:
    """The sequence positions of this device's ``local`` zigzag positions."""
    i = jax.lax.axis_index(axis)
    chunk = local // 2
    return jnp.concatenate([i * chunk + jnp.arange(chunk), (2 * n - 1 - i) * chunk + jnp.arange(chunk)])


def _local_attention(
    q, k, v, seg, sinks, sliding, *, names, mesh_axis, n, strategy, pos, key_pos, head, scale, causal, soft_cap,
    window, has_sinks, key_block,
):  # fmt: skip
    """One device's part (inside ``shard_map``): its zigzag queries over every key of the sequence."""
    dim_q, dim_seg = names["q"].index(pos), names["seg"].index(pos)
    dim_k, dim_v = names["k"].index(key_pos), names["v"].index(key_pos)
    local = q.shape[dim_q]
    half = local // 2
    i = jax.lax.axis_index(mesh_axis)
    qpos = _zigzag_positions(mesh_axis, n, local)
    Q = hax.named(_zigzag(q, dim_q, mesh_axis, n), names["q"]) * jnp.asarray(scale, q.dtype)
    zigzag_seg = _zigzag(seg, dim_seg, mesh_axis, n)
    QSeg = hax.named(zigzag_seg, names["seg"])
    QPos = hax.named(qpos, (pos,))
    k_names, v_names = names["k"], names["v"]
    kseg_names = tuple(key_pos if x == pos else x for x in names["seg"])

    def block_update(carry, queries, K, V, KPos, KSeg):
        """The online-softmax update of ``carry`` (running max, sum of weights, weighted sum of
        values) for ``queries`` (scaled queries, their positions, their segments) over one block
        of keys."""
        m, total, acc = carry
        Qb, QPosb, QSegb = queries
        scores = hax.dot(Qb, K, axis=head).astype(jnp.float32)
        if soft_cap is not None:
            scores = hax.tanh(scores / soft_cap) * soft_cap
        KeyAxis = KPos.axes[0]
        allowed = QSegb.broadcast_axis(KeyAxis) == KSeg
        QAt = QPosb.broadcast_axis(KeyAxis)
        if causal:
            allowed = allowed & (KPos <= QAt)
        if window is not None:
            allowed = allowed & ((KPos > QAt - window) | ~sliding)
        m_new = hax.maximum(m, hax.max(hax.where(allowed, scores, _NEG), axis=key_pos))
        p = hax.where(allowed, hax.exp(scores - m_new), 0.0)
        correction = hax.exp(m - m_new)
        total = total * correction + hax.sum(p, axis=key_pos)
        acc = acc * correction + hax.dot(p.astype(V.dtype), V, axis=key_pos).astype(jnp.float32)
        return m_new, total, acc

    one_block = jax.checkpoint(block_update)  # the backward pass recomputes a block's scores, never stores them

    def block(carry, queries, K, V, KPos, KSeg):
        """``one_block`` over the keys ``key_block`` at a time (a scan), where there are more."""
        size = KPos.axes[0].size
        if size <= key_block or size % key_block:
            return one_block(carry, queries, K, V, KPos, KSeg)
        Blocks, Keys = Axis("key_block", size // key_block), Axis(key_pos, key_block)
        split = tuple(hax.unflatten_axis(x, key_pos, (Blocks, Keys)) for x in (K, V, KPos, KSeg))

        def step(carry, keys):
            return one_block(carry, queries, *keys), None

        carry, _ = hax.scan(step, Blocks)(carry, split)
        return carry

    stat_axes = tuple(ax for ax in Q.axes if ax.name != head)
    VHead = Axis(names["v"][-1], v.shape[-1])
    carry = (
        hax.full(stat_axes, _NEG, jnp.float32),
        hax.zeros(stat_axes, jnp.float32),
        hax.zeros((*stat_axes, VHead), jnp.float32),
    )
    queries = (Q, QPos, QSeg)

    def halves(tree, which):
        part = slice(0, half) if which == 0 else slice(half, local)
        return jax.tree.map(lambda x: x[pos, part], tree, is_leaf=lambda x: isinstance(x, NamedArray))

    def joined(low, high):
        return jax.tree.map(
            lambda a, b: hax.concatenate(pos, [a, b]), low, high, is_leaf=lambda x: isinstance(x, NamedArray)
        )

    if strategy == "all_gather":
        K = hax.named(jax.lax.all_gather(k, mesh_axis, axis=dim_k, tiled=True), k_names)
        V = hax.named(jax.lax.all_gather(v, mesh_axis, axis=dim_v, tiled=True), v_names)
        KSeg = hax.named(jax.lax.all_gather(seg, mesh_axis, axis=dim_seg, tiled=True), kseg_names)
        KPos = hax.arange(Axis(key_pos, local * n))
        # Block by block over the gathered keys (each device's S/N of them), so that a block of
        # scores is S/N x S/N, as in the ring. Block j holds chunks 2j and 2j + 1: our early chunk
        # i sees them only when 2j <= i; otherwise only our late chunk is computed.
        for j in range(n):
            part = slice(j * local, (j + 1) * local)
            keys = (K[key_pos, part], V[key_pos, part], KPos[key_pos, part], KSeg[key_pos, part])
            if not causal:
                carry = block(carry, queries, *keys)
                continue

            def both(carry, keys=keys):
                return block(carry, queries, *keys)

            def late_only(carry, keys=keys):
                return joined(halves(carry, 0), block(halves(carry, 1), halves(queries, 1), *keys))

            carry = jax.lax.cond(2 * j <= i, both, late_only, carry)
    else:
        k, v = _zigzag(k, dim_k, mesh_axis, n), _zigzag(v, dim_v, mesh_axis, n)
        kseg, kpos = zigzag_seg, qpos  # the keys start in the queries' layout
        ring = [(d, (d + 1) % n) for d in range(n)]
        for step in range(n):
            if step:
                k, v, kseg, kpos = (jax.lax.ppermute(x, mesh_axis, ring) for x in (k, v, kseg, kpos))
            K, V = hax.named(k, k_names), hax.named(v, v_names)
            KPos, KSeg = hax.named(kpos, (key_pos,)), hax.named(kseg, kseg_names)
            if step == 0 or not causal:
                carry = block(carry, queries, K, V, KPos, KSeg)
                continue
            # The keys come from device j = i - step (mod n), which holds chunks j and 2n - 1 - j;
            # ours are i and 2n - 1 - i. Earlier devices (j < i): every query sees their chunk j
            # and none their chunk 2n - 1 - j. Later ones (j > i): only our late chunk sees them,
            # all of both. Half a block either way.
            j = (i - step) % n

            def earlier(carry, K=K, V=V, KPos=KPos, KSeg=KSeg):
                first = slice(0, half)
                return block(
                    carry, queries, K[key_pos, first], V[key_pos, first], KPos[key_pos, first], KSeg[key_pos, first]
                )

            def later(carry, K=K, V=V, KPos=KPos, KSeg=KSeg):
                return joined(halves(carry, 0), block(halves(carry, 1), halves(queries, 1), K, V, KPos, KSeg))

            carry = jax.lax.cond(j < i, earlier, later, carry)
    m, total, acc = carry
    if has_sinks:
        total = total + hax.exp(hax.named(sinks, names["sinks"]).astype(jnp.float32) - m)
    out = (acc / total).rearrange((*stat_axes, VHead))
    return _unzigzag(out.array.astype(q.dtype), dim_q, mesh_axis, n)
