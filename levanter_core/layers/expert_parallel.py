"""Expert parallelism: a mixture-of-experts layer whose experts are split over devices.

When the compute mapping splits the ``experts`` axis over a mesh axis (``trainer.mesh``:
``axes: {expert: N}`` with ``shared_mapping: {experts: expert}``), each device holds the weights
of ``E / N`` experts (and, with them, their optimizer state) and its own share of the batch's
tokens (the batch is split over ``expert`` too, by default). The router runs where the tokens
are; the chosen experts' work is exchanged by two ``all_to_all`` s over the expert axis:

1. each device sorts its ``(token, chosen expert)`` pairs by expert, which groups them by the
   device that holds the expert, and writes them into ``N`` send slots of ``C`` rows each (one
   slot per device), with the local number of each row's expert;
2. ``all_to_all``: slot ``j`` of every device goes to device ``j``, which now holds up to
   ``N x C`` rows for its experts, sorts them by expert and runs them through its experts by
   :func:`jax.lax.ragged_dot` (empty rows are grouped last and not computed into any expert);
3. ``all_to_all`` back: each row's result returns to the slot it came from, and each token sums
   its ``k`` results weighted by the router, as on one device.

**Dropless or capacity.** With ``C`` equal to the device's own number of pairs (``tokens x k``)
no pair can be dropped, even if every token of every device chose experts of one device: the
default, exact, at the cost of ``N`` times the pairs' memory in the exchange buffers and ``N``
times their bytes on the wire. ``trainer.expert_capacity_factor`` ``c`` sets ``C = ceil(c x
tokens x k / N)`` instead (GShard's capacity): ``c`` times the balanced load; the pairs past a
device's slot are dropped (their expert's output counts as zero for that token, and its other
experts and shared experts still apply) in a fixed order (by expert, then token), so a run is
reproducible. XLA's CPU backend has no ragged all-to-all, so the exchange is padded to ``C`` on
every backend.

**Everything else is one device's.** The router's logits, choices, weights and its
load-balancing statistics are computed on the tokens where they are, under the mapping (XLA
gathers what the statistics sum over), so the router losses are those of one device. The
experts' ``mlp`` axis may be split too (tensor parallelism, ``mlp -> model`` by default): each
device then computes its part of each expert's hidden layer and the down projection's partial
sums are added over that axis (``psum``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from jax.sharding import PartitionSpec

from levanter_core.layers.context_parallel import split_mesh_axis, without_mapping

_CAPACITY: contextvars.ContextVar[float | None] = contextvars.ContextVar("expert_capacity_factor", default=None)


@contextlib.contextmanager
def expert_capacity(factor: float | None) -> Iterator[None]:
    """Exchange the pairs of expert-parallel layers traced inside this block with capacity
    ``factor`` (None: dropless); the trainer enters it from ``trainer.expert_capacity_factor``."""
    if factor is not None and not factor > 0:
        raise ValueError(f"the expert capacity factor is a positive number, or None for dropless; got {factor}")
    token = _CAPACITY.set(factor)
    try:
        yield
    finally:
        _CAPACITY.reset(token)


def _mapped(name: str) -> list[str]:
    mapping = hax.partitioning.current_thread_local_mapping() or {}
    physical = mapping.get(name)
    if physical is None:
        return []
    return [physical] if isinstance(physical, str) else list(physical)


def expert_mesh_axis(Experts: Axis) -> str | None:
    """The mesh axis the current compute mapping splits ``Experts`` over, when it splits it over
    more than one device; None otherwise (the layer then runs as on one device)."""
    axis = split_mesh_axis(Experts.name, "expert parallelism")
    if axis is None:
        return None
    devices = hax.partitioning._resolve_mesh().shape[axis]
    if Experts.size % devices:
        raise ValueError(
            f"{Experts.size} experts do not split evenly over the {devices} devices of the "
            f"{axis!r} mesh axis; choose an expert axis size that divides the number of experts"
        )
    return axis


def capacity(pairs: int, devices: int, factor: float | None) -> int:
    """Rows per device and destination in the exchange: ``pairs`` (dropless) when ``factor`` is
    None, else ``ceil(factor x pairs / devices)``, at least one and at most ``pairs``."""
    if factor is None:
        return pairs
    return max(1, min(pairs, math.ceil(factor * pairs / devices)))


ExpertFn = Callable[[jax.Array, jax.Array, dict[str, jax.Array]], jax.Array]
"""The experts of one device on rows sorted by local expert: ``(rows (R, embed), group sizes
(local experts,), the local weights by field name) -> (R, embed)`` partial sums (before the
reduction over a split ``mlp`` axis, without the down projection's bias)."""


def expert_parallel_apply(
    x: NamedArray,
    chosen: NamedArray,
    weights: NamedArray,
    params: dict[str, NamedArray],
    *,
    Experts: Axis,
    TopExperts: Axis,
    Embed: Axis,
    Mlp: Axis,
    mesh_axis: str,
    expert_fn: ExpertFn,
    down_bias: NamedArray | None = None,
) -> NamedArray:
    """``sum_j weights[j] * expert[chosen[j]](x)`` for each token of ``x`` ``(..., embed)``, with
    ``chosen`` and ``weights`` ``(..., top_experts)`` (the same leading axes as ``x``) and the
    experts' weights ``params`` (each with ``Experts`` split over ``mesh_axis``), which
    ``expert_fn`` receives with their experts dimension first and the others in their order.
    ``down_bias`` ``(experts, embed)``: added once to each row's result, after the sums over a
    split ``mlp`` axis. Returns ``x``'s axes, in ``x``'s dtype."""
    mesh = hax.partitioning._resolve_mesh()
    n = mesh.shape[mesh_axis]
    token_axes = tuple(ax for ax in x.axes if ax.name != Embed.name)
    x = x.rearrange((*token_axes, Embed))
    chosen = chosen.rearrange((*token_axes, TopExperts))
    weights = weights.rearrange((*token_axes, TopExperts))
    if _mapped(Embed.name):
        raise ValueError(
            f"expert parallelism needs the {Embed.name!r} axis whole while computing; the compute mapping "
            f"splits it over {_mapped(Embed.name)}"
        )
    mlp_axes = tuple(_mapped(Mlp.name))

    def spec(axes: tuple[Axis, ...]) -> PartitionSpec:
        mapping = dict(hax.partitioning.current_thread_local_mapping() or {})
        return PartitionSpec(*(mesh_axis if ax.name == Experts.name else mapping.get(ax.name) for ax in axes))

    names = sorted(params)
    arrays = [params[k].rearrange((Experts, ...)) for k in names]
    token_spec = spec(x.axes)
    local_tokens = math.prod(ax.size for ax in token_axes) // math.prod(
        mesh.shape[m] for part in token_spec[:-1] if part for m in ([part] if isinstance(part, str) else part)
    )
    pairs = local_tokens * TopExperts.size
    rows = capacity(pairs, n, _CAPACITY.get())
    body = functools.partial(
        _local_experts,
        names=names,
        mesh_axis=mesh_axis,
        n=n,
        rows=rows,
        mlp_axes=mlp_axes,
        expert_fn=expert_fn,
    )
    bias = down_bias.rearrange((Experts, Embed)).array if down_bias is not None else jnp.zeros((Experts.size, 0))
    out = jax.shard_map(
        without_mapping(body),
        mesh=mesh,
        in_specs=(token_spec, spec(chosen.axes), spec(weights.axes), [spec(a.axes) for a in arrays], PartitionSpec()),
        out_specs=token_spec,
        check_vma=False,
    )(x.array, chosen.array, weights.array, [a.array for a in arrays], bias)
    return hax.named(out, x.axes)


def dropped_fraction(chosen: NamedArray, *, Experts: Axis, TopExperts: Axis, mesh_axis: str) -> NamedArray:
    """The share of the (token, expert) pairs of ``chosen`` ``(..., top_experts)`` (split over
    the devices as the tokens are) that :func:`expert_parallel_apply` drops under the capacity
    factor in effect: on each device, the pairs past ``C`` for a destination device. 0 when
    dropless. A scalar; the same on every device."""
    factor = _CAPACITY.get()
    if factor is None:
        return hax.named(jnp.zeros((), jnp.float32), ())
    mesh = hax.partitioning._resolve_mesh()
    n = mesh.shape[mesh_axis]
    token_axes = tuple(ax for ax in chosen.axes if ax.name != TopExperts.name)
    chosen = chosen.rearrange((*token_axes, TopExperts))
    mapping = dict(hax.partitioning.current_thread_local_mapping() or {})
    token_spec = PartitionSpec(*(mapping.get(ax.name) for ax in chosen.axes))
    split_over = tuple(m for part in token_spec if part for m in ([part] if isinstance(part, str) else part))
    local_pairs = chosen.size // math.prod(mesh.shape[m] for m in split_over)
    rows = capacity(local_pairs, n, factor)
    local_experts = Experts.size // n

    def count(local: jax.Array) -> jax.Array:
        per_destination = jnp.bincount(local.reshape(-1) // local_experts, length=n)
        dropped = jnp.sum(jnp.maximum(per_destination - rows, 0)).astype(jnp.float32)
        return jax.lax.psum(dropped, split_over) if split_over else dropped

    total = jax.shard_map(
        without_mapping(count), mesh=mesh, in_specs=(token_spec,), out_specs=PartitionSpec(), check_vma=False
    )(chosen.array)
    return hax.named(total / chosen.size, ())


def _local_experts(
    x: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    arrays: list[jax.Array],
    bias: jax.Array,
    *,
    names: list[str],
    mesh_axis: str,
    n: int,
    rows: int,
    mlp_axes: tuple[str, ...],
    expert_fn: ExpertFn,
) -> jax.Array:
    """One device's part: its tokens' pairs out to the experts' devices and back."""
    k = chosen.shape[-1]
    embed = x.shape[-1]
    tokens = x.reshape(-1, embed)
    pairs = chosen.reshape(-1)
    per_device = dict(zip(names, arrays))  # each with its experts first
    local_experts = next(iter(per_device.values())).shape[0]

    # 1. the pairs sorted by expert (so by destination device), each at a row of its destination's slot
    order = jnp.argsort(pairs, stable=True)
    expert_sorted = pairs[order]
    dest = expert_sorted // local_experts
    counts = jnp.bincount(dest, length=n)
    row_in_slot = jnp.arange(pairs.size) - (jnp.cumsum(counts) - counts)[dest]
    kept = row_in_slot < rows  # past the slot: dropped (only with a capacity factor)
    send = jnp.zeros((n, rows, embed), x.dtype).at[dest, row_in_slot].set(tokens[order // k], mode="drop")
    send_expert = jnp.full((n, rows), local_experts, jnp.int32)
    send_expert = send_expert.at[dest, row_in_slot].set((expert_sorted % local_experts).astype(jnp.int32), mode="drop")

    # 2. to the experts' devices; their rows sorted by local expert, empty rows last
    received = jax.lax.all_to_all(send, mesh_axis, 0, 0, tiled=True).reshape(n * rows, embed)
    received_expert = jax.lax.all_to_all(send_expert, mesh_axis, 0, 0, tiled=True).reshape(n * rows)
    by_expert = jnp.argsort(received_expert, stable=True)
    group_sizes = jnp.bincount(received_expert, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    computed = expert_fn(received[by_expert], group_sizes, per_device)
    if mlp_axes:
        computed = jax.lax.psum(computed, mlp_axes)
    if bias.shape[-1]:
        present = received_expert[by_expert] < local_experts
        b = jnp.take(_local_rows(bias, mesh_axis, local_experts), received_expert[by_expert], axis=0, mode="clip")
        computed = computed + jnp.where(present[:, None], b, 0).astype(computed.dtype)
    results = jnp.zeros_like(computed).at[by_expert].set(computed).reshape(n, rows, embed)

    # 3. back to the pairs' own devices and rows; each token's k results weighted and summed
    returned = jax.lax.all_to_all(results, mesh_axis, 0, 0, tiled=True)
    per_pair_sorted = returned.at[dest, row_in_slot].get(mode="fill", fill_value=0)
    per_pair_sorted = jnp.where(kept[:, None], per_pair_sorted, 0)
    per_pair = jnp.zeros_like(per_pair_sorted).at[order].set(per_pair_sorted).reshape(-1, k, embed)
    w = weights.reshape(-1, k).astype(per_pair.dtype)
    out = jnp.einsum("tke,tk->te", per_pair, w)
    return out.astype(x.dtype).reshape(x.shape)


def _local_rows(bias: jax.Array, mesh_axis: str, local_experts: int) -> jax.Array:
    """This device's experts' rows of a replicated ``(experts, ...)`` array."""
    start = jax.lax.axis_index(mesh_axis) * local_experts
    return jax.lax.dynamic_slice_in_dim(bias, start, local_experts, axis=0)


__all__ = ["capacity", "dropped_fraction", "expert_capacity", "expert_mesh_axis", "expert_parallel_apply"]
