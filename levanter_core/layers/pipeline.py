"""Pipeline parallelism: a stack of layers split into stages over devices, the batch fed
through it in microbatches.

When the compute mapping splits the stack's ``layers`` axis over a mesh axis of ``S`` devices
(``trainer.mesh``: ``axes: {stage: S}``, which maps ``layers`` onto ``stage`` by default), each
device holds ``L / S`` consecutive layers (and, with them, their optimizer state): stage ``s``
holds layers ``s L/S`` to ``(s+1) L/S - 1``. :func:`fold_layers` then runs the stack as a
pipeline (GPipe's schedule, written as one loop that XLA partitions over the stages):

1. the batch is cut into ``M`` microbatches (``trainer.pipeline_microbatches``); microbatch
   ``m`` holds rows ``m, m + M, m + 2M, ...``, so that each keeps the batch's split over the
   data-parallel devices;
2. at each of ``M + S - 1`` steps every stage runs its layers on the activations it holds (all
   stages at once: a ``vmap`` over the stage axis, which XLA places one stage per device
   group), then the activations move one stage on (``roll`` along the stage axis: a
   ``collective-permute`` between neighbours) and stage 0 takes the next microbatch;
3. what leaves the last stage at steps ``S - 1`` to ``M + S - 2`` is microbatch ``0`` to
   ``M - 1``'s output, put back in the batch's order.

The backward pass is the same loop reversed (JAX's transpose of it). During the first and last
``S - 1`` steps some stages work on nothing useful: the **bubble**, a fraction
``(S - 1) / (M + S - 1)`` of each stage's time (:func:`bubble_fraction`); more microbatches
shrink it. Arguments of the layers that are per row of the batch (positions, the attention
mask's segment ids) travel with their microbatch; arguments per layer (a sliding-window flag)
are split with the layers; the rest are the same everywhere.

Everything a layer computes on a row is what it computes on one device; only the sums over
the batch (the gradients of the weights) add microbatches in another order, so a pipelined
step gives one device's loss and gradients up to rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, TypeVar

import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, AxisSelector, NamedArray
from jax.sharding import PartitionSpec

from levanter_core.layers.context_parallel import split_mesh_axis

STAGE = "stage"
"""The logical axis of a pipeline's stages (mapped onto the mesh axis that splits the layers)."""
MICROBATCH = "microbatch"
"""The logical axis of a pipeline's microbatches."""

T = TypeVar("T")

_MICROBATCHES: contextvars.ContextVar[int | None] = contextvars.ContextVar("pipeline_microbatches", default=None)


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


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The fraction of each stage's time spent idle (on no microbatch) in a pipeline of
    ``stages`` stages fed ``microbatches`` microbatches: ``(S - 1) / (M + S - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


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


def pipeline_fold(
    stack: hnn.Stacked,
    x: NamedArray,
    *args: Any,
    mesh_axis: str,
    batch: AxisSelector = "batch",
    microbatches: int | None = None,
    unroll: int | bool | None = None,
    **kwargs: Any,
) -> NamedArray:
    """``stack.fold(x, *args, **kwargs)`` run as a pipeline whose stages are split over
    ``mesh_axis`` (see the module's description). ``microbatches``: how many (None: the
    :func:`pipeline_microbatches` in effect where it divides the rows each data-parallel device
    group holds, else :func:`default_microbatches` of those rows)."""
    mesh = hax.partitioning._resolve_mesh()
    stages = int(mesh.shape[mesh_axis]) if mesh is not None else 1
    Layers = stack.Block
    if Layers.size % stages:
        raise ValueError(
            f"{Layers.size} layers do not split evenly into the {stages} stages of the {mesh_axis!r} mesh axis"
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
    Stage, Sub = Axis(STAGE, stages), Layers.resize(Layers.size // stages)
    Micro, Rows = Axis(MICROBATCH, count), Batch.resize(Batch.size // count)
    Steps = Axis("pipeline_step", count + stages - 1)

    staged_raw: set[int] = set()  # ids of unnamed per-layer arrays (one row per layer), split too

    def by_stage(leaf: Any) -> Any:
        if isinstance(leaf, NamedArray):
            if Layers.name in leaf.shape:
                return hax.unflatten_axis(leaf, Layers.name, (Stage, Sub))
            return leaf
        if isinstance(leaf, jax.Array) and leaf.ndim and leaf.shape[0] == Layers.size:  # as hax.fold slices them
            split = leaf.reshape(stages, Sub.size, *leaf.shape[1:])
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
        staged = dataclasses.replace(stack, stacked=tree_map(by_stage, stack.stacked), Block=Sub)
        stage_args, stage_kwargs = tree_map(by_stage, (args, kwargs))
        micro_x = by_microbatch(x)
        micro_args, micro_kwargs = tree_map(by_microbatch, (stage_args, stage_kwargs))
        stage_ids = hax.arange(Stage)

        def run_stage(
            layers: hnn.Stacked, h: NamedArray, stage_args: tuple[Any, ...], stage_kwargs: dict[str, Any]
        ) -> NamedArray:
            out: NamedArray = layers.fold(h, *stage_args, unroll=unroll, **stage_kwargs)
            return out

        def step(held: NamedArray, t: NamedArray) -> tuple[NamedArray, NamedArray]:
            # stage s works on microbatch t - s (clipped: a stage in the bubble repeats an end one)
            which = hax.clip(t - stage_ids, 0, count - 1)

            def for_stages(leaf: Any) -> Any:
                if isinstance(leaf, NamedArray) and MICROBATCH in leaf.shape:
                    return leaf[MICROBATCH, which]
                return leaf

            fresh = micro_x[MICROBATCH, jnp.minimum(t.array, count - 1)]
            inputs = hax.where(stage_ids == 0, fresh, _shift(held, mesh_axis))
            inputs = hax.shard(inputs)
            step_args, step_kwargs = tree_map(for_stages, (micro_args, micro_kwargs))
            out = hax.vmap(run_stage, Stage, default=lambda leaf: 0 if id(leaf) in staged_raw else None)(
                staged, inputs, step_args, step_kwargs
            )
            out = hax.shard(out)
            return out, out

        held = hax.shard(hax.zeros((Stage, *micro_x[MICROBATCH, 0].axes), dtype=x.dtype))
        _, leaving = hax.scan(step, Steps)(held, hax.arange(Steps))
        # each stage kept what it computed at each step; the last stage's, from step S - 1 on, are
        # the microbatches' outputs (moved off its devices once, after the loop)
        outputs = hax.rename(leaving[Steps.name, stages - 1 :, STAGE, stages - 1], {Steps.name: MICROBATCH})
        order = [ax for ax in outputs.axes if ax.name != MICROBATCH]
        at = [ax.name for ax in order].index(Batch.name)
        outputs = hax.rearrange(outputs, (*order[: at + 1], Micro, *order[at + 1 :]))
        merged = hax.flatten_axes(outputs, (Rows, Micro), Batch)
        return hax.shard(hax.rearrange(merged, x.axes))


def _shift(held: NamedArray, mesh_axis: str) -> NamedArray:
    """Each stage's activations to the next stage's devices (stage 0 gets zeros; the last
    stage's go nowhere): one ``collective-permute`` between neighbours on ``mesh_axis``, and
    one back in the backward pass. (A ``roll`` would also send the last stage's to the first,
    which XLA does as a second exchange.)"""
    mesh = hax.partitioning._resolve_mesh()
    stages = int(mesh.shape[mesh_axis])
    at = held.axis_indices(STAGE)
    spec: list[str | None] = [None] * held.ndim
    spec[at] = mesh_axis

    def shift(local: jax.Array) -> jax.Array:
        sent: jax.Array = jax.lax.ppermute(local, mesh_axis, [(i, i + 1) for i in range(stages - 1)])
        return sent

    moved = jax.shard_map(
        shift, mesh=mesh, in_specs=PartitionSpec(*spec), out_specs=PartitionSpec(*spec), axis_names={mesh_axis}
    )(held.array)
    return NamedArray(moved, held.axes)


__all__ = [
    "MICROBATCH",
    "STAGE",
    "bubble_fraction",
    "default_microbatches",
    "fold_layers",
    "pipeline_fold",
    "pipeline_microbatches",
    "stage_mesh_axis",
]
