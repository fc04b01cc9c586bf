"""Pipeline parallelism: a stack of layers split into stages over devices, the batch fed
through it in microbatches.

When the compute mapping splits the stack's ``layers`` axis over a mesh axis of ``S`` devices
(``trainer.mesh``: ``axes: {stage: S}``, which maps ``layers`` onto ``stage`` by default), each
device holds ``L / S`` consecutive layers (and, with them, their optimizer state): stage ``s``
holds layers ``s L/S`` to ``(s+1) L/S - 1``. :func:`fold_layers` then runs the stack as a
pipeline, written as one loop that XLA partitions over the stages:

1. the batch is cut into ``M`` microbatches (``trainer.pipeline_microbatches``); microbatch
   ``m`` holds rows ``m, m + M, m + 2M, ...``, so that each keeps the batch's split over the
   data-parallel devices;
2. at each of ``M + S - 1`` steps every stage runs its layers on the activations it holds (all
   stages at once: a ``vmap`` over the stage axis, which XLA places one stage per device
   group), then the activations move one stage on (a ``collective-permute`` around the ring of
   stages) and stage 0 takes the next microbatch;
3. what leaves the last stage comes back to stage 0, which keeps it: after the last step it
   holds every microbatch's output, put back in the batch's order.

This is GPipe's schedule; the backward pass is the same loop reversed (JAX's transpose of it).
During the first and last ``S - 1`` steps some stages work on nothing useful: the **bubble**,
a fraction ``(S - 1) / (M + S - 1)`` of each stage's time (:func:`bubble_fraction`). More
microbatches shrink it, each with fewer rows.

The **circular** schedule (``trainer.pipeline_repeats``: ``R`` rounds, as MaxText's) shrinks
it where the rows run out: the stack is cut into ``S R`` chunks of ``L / (S R)`` layers, chunk
``r S + s`` on stage ``s``, and each microbatch goes round the ring of stages ``R`` times, back
to stage 0 after each round (so ``M >= S``: stage 0 takes a microbatch's next round only once
it has left the last stage). ``R M + S - 1`` steps, each of ``1 / R`` of a stage's layers: a
bubble of ``(S - 1) / (R M + S - 1)``. Its price: the parameters are stored with each stage's
``L / S`` consecutive layers (what checkpoints, other meshes and exports read), so each step
first moves the chunks to the stages that run them (one all-to-all over the stages, each device
sending every stage ``ceil(R / S)`` chunks) and their gradients back. Each layer picks its
round's weights inside its own step of the fold, within its gradient checkpoint, so the
backward pass picks them again rather than keeping every step's chunk.

:func:`scan_layers` runs a stack whose layers return, beside their output, means over their
tokens (a mixture of experts' router statistics): each microbatch's are averaged over the
microbatches, the whole batch's mean.

Arguments of the layers that are per row of the batch (positions, the attention mask's segment
ids) travel with their microbatch; arguments per layer (a sliding-window flag) are split with
the layers; the rest are the same everywhere. Everything a layer computes on a row is what it
computes on one device; only the sums over the batch (the gradients of the weights) add
microbatches in another order, so a pipelined step gives one device's loss and gradients up to
rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, TypeVar

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, AxisSelector, NamedArray
from jax.sharding import PartitionSpec

from levanter_core.layers.context_parallel import split_mesh_axis

STAGE = "stage"
"""The logical axis of a pipeline's stages (mapped onto the mesh axis that splits the layers)."""
MICROBATCH = "microbatch"
"""The logical axis of a pipeline's microbatches."""
REPEAT = "pipeline_repeat"
"""The logical axis of a circular pipeline's rounds (each stage's chunks of layers)."""

T = TypeVar("T")

_MICROBATCHES: contextvars.ContextVar[int | None] = contextvars.ContextVar("pipeline_microbatches", default=None)
_REPEATS: contextvars.ContextVar[int] = contextvars.ContextVar("pipeline_repeats", default=1)


@contextlib.contextmanager
def pipeline_microbatches(count: int | None) -> Iterator[None]:
    """Feed pipelines traced inside this block ``count`` microbatches per batch (None: the
    default of :func:`default_microbatches`); the trainer enters it from
    ``trainer.pipeline_microbatches``."""
    if count is not None and count < 1:
        raise ValueError(f"a pipeline's number of microbatches is a positive number, or None; got {count}")
    token = _MICROBATCHES.set(count)
    try:
        yield
    finally:
        _MICROBATCHES.reset(token)


@contextlib.contextmanager
def pipeline_repeats(count: int) -> Iterator[None]:
    """Run pipelines traced inside this block in ``count`` rounds (the circular schedule; 1:
    GPipe's); the trainer enters it from ``trainer.pipeline_repeats``."""
    if count < 1:
        raise ValueError(f"a pipeline's number of rounds is a positive number; got {count}")
    token = _REPEATS.set(count)
    try:
        yield
    finally:
        _REPEATS.reset(token)


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The fraction of each stage's time spent idle (on no microbatch) in a pipeline of
    ``stages`` stages fed ``microbatches`` microbatches in ``repeats`` rounds (the circular
    schedule; 1: GPipe's): ``(S - 1) / (R M + S - 1)``."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def default_microbatches(stages: int, rows: int) -> int:
    """The number of microbatches when none is given: the largest divisor of ``rows`` (the rows
    of the batch each data-parallel device group holds) up to ``4 x stages`` (a bubble of at
    most a fifth of the time for large pipelines, while each microbatch keeps rows to work on)."""
    return max(d for d in range(1, min(rows, 4 * stages) + 1) if rows % d == 0)


def stage_mesh_axis(Layers: AxisSelector) -> str | None:
    """The mesh axis the current compute mapping splits ``Layers`` over, when it splits it over
    more than one device; None otherwise (the stack then runs as on one device)."""
    name = Layers if isinstance(Layers, str) else Layers.name
    return split_mesh_axis(name, "pipeline parallelism")


def fold_layers(
    stack: Any,
    x: NamedArray,
    *args: Any,
    batch: AxisSelector = "batch",
    unroll: int | bool | None = None,
    **kwargs: Any,
) -> NamedArray:
    """``stack.fold(x, *args, unroll=unroll, **kwargs)``: each layer of ``stack`` applied to ``x``
    in turn, as a pipeline over devices when the compute mapping splits the stack's layers
    (see the module's description), else as ``stack.fold``. ``batch``: the axis of ``x`` (and of
    the arguments) whose rows are independent, cut into microbatches."""
    if not isinstance(stack, hnn.Stacked):
        return stack.fold(x, *args, unroll=unroll, **kwargs)
    mesh_axis = stage_mesh_axis(stack.Block)
    if mesh_axis is None:
        return stack.fold(x, *args, unroll=unroll, **kwargs)
    return pipeline_fold(stack, x, *args, mesh_axis=mesh_axis, batch=batch, unroll=unroll, **kwargs)


def scan_layers(
    stack: Any,
    x: NamedArray,
    *args: Any,
    batch: AxisSelector = "batch",
    unroll: int | bool | None = None,
    **kwargs: Any,
) -> tuple[NamedArray, Any]:
    """``stack.scan(x, *args, unroll=unroll, **kwargs)``: ``x`` through each layer of ``stack``
    in turn, and what each layer returns beside its new ``x``, stacked along the layers. As a
    pipeline when the compute mapping splits the stack's layers (see the module's description),
    where what a layer returns beside ``x`` must be **means over the rows and positions** of its
    input (a mixture of experts' router statistics): each microbatch's are averaged, which is
    the batch's mean, since the microbatches are of equal size."""
    mesh_axis = stage_mesh_axis(stack.Block) if isinstance(stack, hnn.Stacked) else None
    if mesh_axis is None:
        out: tuple[NamedArray, Any] = stack.scan(x, *args, unroll=unroll, **kwargs)
        return out
    return _pipeline(stack, x, args, kwargs, mesh_axis=mesh_axis, batch=batch, unroll=unroll, means=True)


def pipeline_fold(
    stack: hnn.Stacked,
    x: NamedArray,
    *args: Any,
    mesh_axis: str,
    batch: AxisSelector = "batch",
    microbatches: int | None = None,
    repeats: int | None = None,
    unroll: int | bool | None = None,
    **kwargs: Any,
) -> NamedArray:
    """``stack.fold(x, *args, **kwargs)`` run as a pipeline whose stages are split over
    ``mesh_axis`` (see the module's description). ``microbatches``: how many (None: the
    :func:`pipeline_microbatches` in effect where it divides the rows each data-parallel device
    group holds, else :func:`default_microbatches` of those rows). ``repeats``: the rounds of a
    circular schedule (None: the :func:`pipeline_repeats` in effect; 1 is GPipe's schedule; a
    batch cut into fewer microbatches than stages, as a small evaluation batch may be, runs in
    GPipe's schedule, which computes the same)."""
    out, _ = _pipeline(
        stack, x, args, kwargs, mesh_axis=mesh_axis, batch=batch, microbatches=microbatches, repeats=repeats,
        unroll=unroll, means=False,
    )  # fmt: skip
    return out


def _pipeline(
    stack: hnn.Stacked,
    x: NamedArray,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    mesh_axis: str,
    batch: AxisSelector,
    unroll: int | bool | None,
    means: bool,
    microbatches: int | None = None,
    repeats: int | None = None,
) -> tuple[NamedArray, Any]:
    """:func:`pipeline_fold`, and with ``means`` :func:`scan_layers`: the output, and what the
    layers return beside it averaged over the microbatches (None without ``means``)."""
    mesh = hax.partitioning._resolve_mesh()
    stages = int(mesh.shape[mesh_axis]) if mesh is not None else 1
    repeats = _REPEATS.get() if repeats is None else repeats
    Layers = stack.Block
    if Layers.size % (stages * repeats):
        raise ValueError(
            f"{Layers.size} layers do not split evenly into the {stages} stages of the {mesh_axis!r} mesh axis"
            + (f" times {repeats} rounds" if repeats > 1 else "")
        )
    Batch = x.resolve_axis(batch if isinstance(batch, str) else batch.name)
    mapped = hax.partitioning.current_thread_local_mapping() or {}
    batch_mesh = mapped.get(Batch.name) or ()
    shards = 1
    for name in [batch_mesh] if isinstance(batch_mesh, str) else batch_mesh:
        shards *= int(mesh.shape[name]) if mesh is not None else 1
    rows = max(Batch.size // shards, 1)
    if microbatches is None:
        # the trainer checks its setting against the training batch; a batch it does not divide
        # (evaluation's) takes the default
        setting = _MICROBATCHES.get()
        microbatches = setting if setting is not None and rows % setting == 0 else default_microbatches(stages, rows)
    count = microbatches
    if Batch.size % count:
        raise ValueError(f"a batch of {Batch.size} rows does not cut into {count} equal pipeline microbatches")
    if repeats > 1 and count < stages:
        # a microbatch's next round would reach stage 0 before it has left the last stage; the
        # trainer checks the training batch, so this is a smaller one (evaluation's): GPipe's
        # schedule computes the same
        repeats = 1
    Stage, Repeat, Sub = Axis(STAGE, stages), Axis(REPEAT, repeats), Layers.resize(Layers.size // (stages * repeats))
    Micro, Rows = Axis(MICROBATCH, count), Batch.resize(Batch.size // count)
    Steps = Axis("pipeline_step", repeats * count + stages - 1)

    staged_raw: set[int] = set()  # ids of unnamed per-layer arrays (one row per layer), split too

    def by_stage(leaf: Any, weight: bool = False) -> Any:
        # layer l = (r S + s) L/(S R) + j is layer j of stage s's chunk of round r; a weight's
        # unnamed array keeps the rounds after the layers (hax.fold then slices a layer's rounds)
        if isinstance(leaf, NamedArray):
            if Layers.name not in leaf.shape:
                return leaf
            if repeats == 1:
                return hax.unflatten_axis(leaf, Layers.name, (Stage, Sub))
            return _by_rounds(leaf, Layers, Stage, Repeat, Sub, mesh_axis)
        if isinstance(leaf, jax.Array) and leaf.ndim and leaf.shape[0] == Layers.size:  # as hax.fold slices them
            split = leaf.reshape(repeats, stages, Sub.size, *leaf.shape[1:]).swapaxes(0, 1)
            split = split[:, 0] if repeats == 1 else split.swapaxes(1, 2) if weight else split
            staged_raw.add(id(split))
            return split
        return leaf

    def by_microbatch(leaf: Any) -> Any:
        if isinstance(leaf, NamedArray) and Batch.name in leaf.shape:
            return hax.unflatten_axis(leaf, Batch.name, (Rows, Micro))
        return leaf

    def tree_map(fn: Any, tree: T) -> T:
        mapped: T = jax.tree.map(fn, tree, is_leaf=lambda v: isinstance(v, NamedArray))
        return mapped

    # the rest of the mapping, with the stages on the mesh axis (hax.vmap then keeps each
    # stage's work on its devices); the layers inside a stage are not split
    mapping = dict(hax.partitioning.current_thread_local_mapping() or {})
    mapping.pop(Layers.name, None)
    mapping[STAGE] = mesh_axis
    with hax.axis_mapping(mapping):
        staged = dataclasses.replace(
            stack, stacked=tree_map(lambda w: by_stage(w, weight=True), stack.stacked), Block=Sub
        )
        stage_args, stage_kwargs = tree_map(by_stage, (args, kwargs))
        micro_args, micro_kwargs = tree_map(by_microbatch, (stage_args, stage_kwargs))
        stage_ids = hax.arange(Stage)
        # each stage's copy of the microbatches: stage 0's is read for its inputs and gets back
        # what leaves the last stage (a microbatch's next round, or its output)
        kept = hax.shard(hax.broadcast_axis(by_microbatch(x), Stage))

        def run_stage(
            layers: hnn.Stacked,
            h: NamedArray,
            stage_args: tuple[Any, ...],
            stage_kwargs: dict[str, Any],
            round_: NamedArray,
        ) -> tuple[NamedArray, Any]:
            if repeats > 1:
                # each layer picks its round's weights inside its own step of the fold (inside its
                # gradient checkpoint): the backward pass picks them again rather than keeping
                # each step's chunk
                by_layer = _RoundOf(layers.stacked, hax.broadcast_axis(round_, Sub))
                layers = dataclasses.replace(layers, stacked=by_layer)
            if means:
                scanned: tuple[NamedArray, Any] = layers.scan(h, *stage_args, unroll=unroll, **stage_kwargs)
                return scanned
            return layers.fold(h, *stage_args, unroll=unroll, **stage_kwargs), None

        def step(carry: tuple[NamedArray, NamedArray], t: NamedArray) -> tuple[tuple[NamedArray, NamedArray], Any]:
            held, kept = carry
            # at step t stage s works on item t - s: microbatch (t - s) mod M in round (t - s) // M
            # (clipped: a stage in the bubble repeats an end one)
            item = hax.clip(t - stage_ids, 0, repeats * count - 1)
            which, rounds = item % count, item // count
            received = _shift(held, mesh_axis)
            # what the last stage finished at step t - 1, item t - S, is back at stage 0
            kept = _keep(kept, received, (t.array - stages) % count, t.array >= stages)
            inputs = hax.where(stage_ids == 0, kept[MICROBATCH, t.array % count], received)
            inputs = hax.shard(inputs)

            def for_stages(leaf: Any) -> Any:
                if isinstance(leaf, NamedArray) and MICROBATCH in leaf.shape:
                    return leaf[MICROBATCH, which]
                return leaf

            step_args, step_kwargs = tree_map(for_stages, (micro_args, micro_kwargs))
            raw = staged_raw
            if repeats > 1:
                step_args, step_kwargs, picked = _round_of_stages((step_args, step_kwargs), rounds, staged_raw)
                raw = staged_raw | picked
            out, per_layer = hax.vmap(run_stage, Stage, default=lambda leaf: 0 if id(leaf) in raw else None)(
                staged, inputs, step_args, step_kwargs, rounds
            )
            return (hax.shard(out), kept), per_layer

        held = hax.shard(hax.zeros((Stage, *kept[STAGE, 0][MICROBATCH, 0].axes), dtype=x.dtype))
        steps = hax.arange(Steps)
        (held, kept), per_step = hax.scan(step, Steps)((held, kept), steps)
        # the last microbatch's output, which left the last stage at the last step
        kept = _keep(kept, _shift(held, mesh_axis), count - 1, True)
        outputs = kept[STAGE, 0]
        merged = hax.flatten_axes(outputs, (Rows, Micro), Batch)
        result = hax.shard(hax.rearrange(merged, x.axes))
        if not means:
            return result, None
        # stage s's chunk of round r ran microbatch m at step r M + m + s
        item = hax.broadcast_axis(steps, Stage) - stage_ids
        share = (
            (hax.broadcast_axis(item // count, Repeat) == hax.arange(Repeat)) & (item >= 0) & (item < repeats * count)
        )
        share = share.astype(jnp.float32) / count

        def averaged(leaf: Any) -> Any:
            if not isinstance(leaf, NamedArray):
                return leaf
            mean = hax.dot(share.astype(leaf.dtype), leaf, axis=Steps)  # (stage, repeat, layers, ...)
            return hax.flatten_axes(hax.rearrange(mean, (Repeat, Stage, Sub, ...)), (Repeat, Stage, Sub), Layers)

        return result, tree_map(averaged, per_step)


def _keep(kept: NamedArray, received: NamedArray, slot: jax.Array | int, valid: jax.Array | bool) -> NamedArray:
    """``kept`` with microbatch ``slot`` replaced by ``received`` where ``valid``."""
    at = kept.axis_indices(MICROBATCH)
    old = jax.lax.dynamic_index_in_dim(kept.array, slot, at, keepdims=False)
    new = received.rearrange([ax for ax in kept.axes if ax.name != MICROBATCH]).array
    value = jnp.where(valid, new, old)
    return NamedArray(jax.lax.dynamic_update_index_in_dim(kept.array, value, slot, at), kept.axes)


def _by_rounds(leaf: NamedArray, Layers: Axis, Stage: Axis, Repeat: Axis, Sub: Axis, mesh_axis: str) -> NamedArray:
    """A stacked weight ``leaf`` (stored with each stage's consecutive layers on its devices)
    as ``(stage, pipeline_repeat, layers, ...)``: stage ``s``'s chunk of round ``r`` is layers
    ``(r S + s) c`` to ``(r S + s + 1) c - 1`` (``c`` layers a chunk), moved to stage ``s``'s
    devices by one ``all-to-all`` over ``mesh_axis`` (each device sends every other at most
    ``ceil(R / S)`` chunks; its gradient comes back the same way)."""
    S, R, c = Stage.size, Repeat.size, Sub.size
    slots = -(-R // S)
    send = np.zeros((S, S, slots), np.int32)  # [from, to, slot]: the local chunk sent
    take = np.zeros((S, R), np.int32)  # [stage, round]: where in what it received
    used = np.zeros((S, S), np.int32)
    for chunk in range(S * R):
        source, local = divmod(chunk, R)
        round_, stage = divmod(chunk, S)
        slot = used[source, stage]
        used[source, stage] += 1
        send[source, stage, slot] = local
        take[stage, round_] = source * slots + slot
    rest = [ax for ax in leaf.axes if ax.name != Layers.name]
    stored = leaf.rearrange((Layers, *rest)).array

    def exchange(block: jax.Array) -> jax.Array:
        me = jax.lax.axis_index(mesh_axis)
        chunks = block.reshape(R, c, *block.shape[1:])
        sent = chunks[jnp.asarray(send)[me]]  # (to, slot, c, ...)
        got: jax.Array = jax.lax.all_to_all(sent, mesh_axis, 0, 0)  # (from, slot, c, ...)
        mine: jax.Array = got.reshape(S * slots, *got.shape[2:])[jnp.asarray(take)[me]]  # (round, c, ...)
        return mine[None]

    mesh = hax.partitioning._resolve_mesh()
    moved = jax.shard_map(
        exchange,
        mesh=mesh,
        in_specs=PartitionSpec(mesh_axis),
        out_specs=PartitionSpec(mesh_axis),
        axis_names={mesh_axis},
    )(stored)
    return NamedArray(moved, (Stage, Repeat, Sub, *rest))


def _round_of_stages(tree: T, rounds: NamedArray, raw: set[int]) -> tuple[Any, ...]:
    """Each stage's per-layer arguments (``tree``) for its round, ``rounds`` (``(stage,)``): the
    ``pipeline_repeat`` axis indexed per stage (a gather local to each stage's devices); ``raw``:
    the ids of unnamed per-layer arrays (``(stage, pipeline_repeat, layers, ...)``). Returns the
    tree's parts and the ids of the unnamed per-stage arrays picked."""
    picked_raw: set[int] = set()
    index = rounds.array

    def by_round(w: jax.Array) -> jax.Array:
        chosen: jax.Array = jax.vmap(lambda w, r: jax.lax.dynamic_index_in_dim(w, r, 0, keepdims=False))(w, index)
        return chosen

    def pick(leaf: Any) -> Any:
        if isinstance(leaf, NamedArray) and REPEAT in leaf.shape:
            order = [leaf.resolve_axis(STAGE), leaf.resolve_axis(REPEAT)]
            rest = [ax for ax in leaf.axes if ax.name not in (STAGE, REPEAT)]
            return NamedArray(by_round(leaf.rearrange((*order, *rest)).array), (order[0], *rest))
        if id(leaf) in raw:
            chosen = by_round(leaf)
            picked_raw.add(id(chosen))
            return chosen
        return leaf

    picked = jax.tree.map(pick, tree, is_leaf=lambda v: isinstance(v, NamedArray))
    return (*picked, picked_raw)


class _RoundOf(eqx.Module):
    """One layer of a circular pipeline's stage with its weights of every round (named arrays
    with a ``pipeline_repeat`` axis; unnamed ones with the rounds first), run as its weights of
    round ``round``."""

    layer: Any
    round: NamedArray

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        r = self.round.array

        def pick(leaf: Any) -> Any:
            if isinstance(leaf, NamedArray):
                return leaf[REPEAT, r] if REPEAT in leaf.shape else leaf
            if isinstance(leaf, jax.Array) and leaf.ndim:
                return jax.lax.dynamic_index_in_dim(leaf, r, 0, keepdims=False)
            return leaf

        layer = jax.tree.map(pick, self.layer, is_leaf=lambda v: isinstance(v, NamedArray))
        return layer(*args, **kwargs)


def _shift(held: NamedArray, mesh_axis: str) -> NamedArray:
    """Each stage's activations to the next stage's devices, the last stage's to stage 0's:
    one ``collective-permute`` around the ring of ``mesh_axis``, and one back in the backward
    pass. (A ``roll`` along the stage axis does the same, but XLA makes several exchanges of
    it.)"""
    mesh = hax.partitioning._resolve_mesh()
    stages = int(mesh.shape[mesh_axis])
    at = held.axis_indices(STAGE)
    spec: list[str | None] = [None] * held.ndim
    spec[at] = mesh_axis

    def shift(local: jax.Array) -> jax.Array:
        sent: jax.Array = jax.lax.ppermute(local, mesh_axis, [(i, (i + 1) % stages) for i in range(stages)])
        return sent

    moved = jax.shard_map(
        shift, mesh=mesh, in_specs=PartitionSpec(*spec), out_specs=PartitionSpec(*spec), axis_names={mesh_axis}
    )(held.array)
    return NamedArray(moved, held.axes)


__all__ = [
    "MICROBATCH",
    "REPEAT",
    "STAGE",
    "bubble_fraction",
    "default_microbatches",
    "fold_layers",
    "pipeline_fold",
    "pipeline_microbatches",
    "pipeline_repeats",
    "scan_layers",
    "stage_mesh_axis",
]
