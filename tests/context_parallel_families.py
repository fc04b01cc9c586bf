"""Each model family's loss and gradients with its work split over devices, beside the same on
one device, with packed documents. Run by tests/test_context_parallel.py and
tests/test_expert_parallel.py in a subprocess whose environment sets 8 simulated CPU devices::

    python tests/context_parallel_families.py OUT.json LAYOUT [LAYOUT@]CONFIG.yaml...

LAYOUT (:data:`LAYOUTS`): ``ring`` or ``all_gather`` (context parallelism by that strategy, 2
data x 4 context), ``expert`` (4 expert x 2 data, the parameters at rest split FSDP-style over
data and the experts over expert), ``expert_context`` (2 data x 2 expert x 2 context),
``expert_model`` (2 data x 2 expert x 2 model: tensor parallelism over heads and the experts'
mlp), ``fsdp_context_model`` (2 data x 2 context x 2 model, the parameters at rest FSDP over
data), ``pipeline`` (4 stages), ``pipeline_fsdp`` (2 stages x 4 data, FSDP within each),
``pipeline_context``, ``pipeline_model`` and ``pipeline_expert`` (2 stages x 2 data x 2
context, model or expert devices, FSDP within each stage) and ``pipeline_circular`` (2 stages x
2 data, FSDP within each, each microbatch making 2 rounds of the stages). A config prefixed ``LAYOUT@`` is compared in that layout instead. Each CONFIG.yaml is a
family's nano config (its ``model:`` section is read, with 64
positions). ``OUT.json`` gets, per config: both losses, and the largest difference of a gradient
from one device's relative to that gradient's largest magnitude, and a mixture of experts'
router terms both ways (keyed ``LAYOUT@name`` for a config given a layout of its own).
"""

from __future__ import annotations

import json
import os
import sys

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import yaml
from haliax import Axis
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from levanter_core.config.base import validate_section
from levanter_core.layers.parallel import parallel_settings
from levanter_core.models.lm import LmExample, lm_loss_and_metrics
from levanter_core.trainer.host_threads import ensure_collective_threads

SEQ_LEN, VOCAB = 64, 128
CONTEXT = (("data", 2), ("context", 4)), {"batch": "data", "position": "context"}, {}
LAYOUTS = {
    # name: (mesh axes and sizes, compute mapping, parameter mapping at rest)
    "ring": CONTEXT,
    "all_gather": CONTEXT,
    "expert": (
        (("data", 2), ("expert", 4)),
        {"batch": ("data", "expert"), "experts": "expert"},
        {"embed": "data", "experts": "expert"},
    ),
    "expert_context": (
        (("data", 2), ("expert", 2), ("context", 2)),
        {"batch": ("data", "expert"), "experts": "expert", "position": "context"},
        {"experts": "expert"},
    ),
    "expert_model": (
        (("data", 2), ("expert", 2), ("model", 2)),
        {"batch": ("data", "expert"), "experts": "expert", "mlp": "model", "heads": "model"},
        {"experts": "expert", "mlp": "model", "heads": "model"},
    ),
    "fsdp_context_model": (
        (("data", 2), ("context", 2), ("model", 2)),
        {"batch": "data", "position": "context", "mlp": "model", "heads": "model"},
        {"embed": "data", "mlp": "model", "heads": "model"},
    ),
    "pipeline": ((("stage", 4),), {"layers": "stage"}, {"layers": "stage"}),
    "pipeline_fsdp": (
        (("stage", 2), ("data", 4)),
        {"batch": "data", "layers": "stage"},
        {"embed": "data", "layers": "stage"},
    ),
    "pipeline_context": (
        (("stage", 2), ("data", 2), ("context", 2)),
        {"batch": "data", "layers": "stage", "position": "context"},
        {"embed": "data", "layers": "stage"},
    ),
    "pipeline_model": (
        (("stage", 2), ("data", 2), ("model", 2)),
        {"batch": "data", "layers": "stage", "mlp": "model", "heads": "model"},
        {"embed": "data", "layers": "stage", "mlp": "model", "heads": "model"},
    ),
    "pipeline_expert": (
        (("stage", 2), ("data", 2), ("expert", 2)),
        {"batch": ("data", "expert"), "layers": "stage", "experts": "expert"},
        {"embed": "data", "layers": "stage", "experts": "expert"},
    ),
    "pipeline_circular": (
        (("stage", 2), ("data", 2)),
        {"batch": "data", "layers": "stage"},
        {"embed": "data", "layers": "stage"},
    ),
}
ROWS = {
    "pipeline_expert": 4,
    "pipeline_context": 4,
    "pipeline_model": 4,
    "pipeline": 4,
    "pipeline_fsdp": 4,
    "pipeline_circular": 4,
    "expert_context": 2,
    "expert_model": 2,
}
"""Rows per batch shard where a layout needs more than one (a pipeline's microbatches), or where
it takes as many rows in all as ``expert`` does (8), so that a family compared in both layouts
is computed on one device only once (:data:`ONE_DEVICE`)."""

REPEATS = {"pipeline_circular": 2}
"""The rounds of a layout's circular pipeline (``trainer.pipeline_repeats``)."""

ONE_DEVICE: dict = {}
"""(config path, rows) -> the one-device loss, gradients and segments of :func:`compare`: the
same model and batch give the same results, so a family compared in two layouts of as many rows
computes them once."""


def batch(key, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and the segment ids of documents of random lengths packed into each row."""
    k_tokens, k_starts = jax.random.split(key)
    tokens = np.asarray(jax.random.randint(k_tokens, (rows, SEQ_LEN), 0, VOCAB))
    starts = np.asarray(jax.random.bernoulli(k_starts, 0.06, (rows, SEQ_LEN))).astype(np.int32)
    return tokens, np.cumsum(starts, axis=1).astype(np.int32)


def loss_and_grads(model, tokens, segments):
    Batch, Pos = Axis("batch", tokens.shape[0]), Axis("position", SEQ_LEN)
    packed = None if segments is None else hax.named(segments, (Batch, Pos))
    example = LmExample(hax.named(tokens, (Batch, Pos)), segment_ids=packed)

    def loss(model):
        value, metrics = lm_loss_and_metrics(model, example)
        return value, {name: v for name, v in metrics.items() if name.startswith("moe/")}

    (value, router), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
    return (value, router), grads


def compare(config_path: str, layout: str) -> dict:
    axes, compute, params = LAYOUTS[layout]
    sizes = [size for _, size in axes]
    devices = np.asarray(jax.devices()[: int(np.prod(sizes))]).reshape(sizes)
    mesh = Mesh(devices, tuple(name for name, _ in axes))
    with open(config_path) as f:
        section = dict(yaml.safe_load(f)["model"])
    section["seq_len"] = SEQ_LEN
    for heavy in ("gradient_checkpointing",):
        section.pop(heavy, None)
    config = validate_section("model", section)
    model = config.build(Axis("vocab", VOCAB), key=jax.random.PRNGKey(0))
    batch_axes = [compute["batch"]] if isinstance(compute.get("batch"), str) else compute.get("batch", [])
    shards = int(np.prod([size for name, size in axes if name in batch_axes]))
    rows = shards * ROWS.get(layout, 1)  # one row per batch shard, or as many as the layout needs
    tokens, segments = batch(jax.random.PRNGKey(1), rows)
    if (config_path, rows) not in ONE_DEVICE:
        try:
            (one_loss, one_router), one_grads = eqx.filter_jit(loss_and_grads)(model, tokens, segments)
        except ValueError as e:  # a family that cannot read packed documents (Hyena's convolutions)
            if "packed" not in str(e):
                raise
            segments = None
            (one_loss, one_router), one_grads = eqx.filter_jit(loss_and_grads)(model, tokens, segments)
        ONE_DEVICE[config_path, rows] = one_loss, one_router, one_grads, segments
    one_loss, one_router, one_grads, segments = ONE_DEVICE[config_path, rows]

    strategy = layout if layout in ("ring", "all_gather") else "ring"

    repeats = REPEATS.get(layout, 1)

    def split(model, tokens, segments):
        settings = parallel_settings(context_attention_strategy=strategy, pipeline_repeats=repeats)
        with hax.axis_mapping(compute), settings:
            return loss_and_grads(model, tokens, segments)

    placed = NamedSharding(mesh, PartitionSpec(compute.get("batch"), compute.get("position")))
    with jax.set_mesh(mesh):
        model = hax.shard_with_axis_mapping(model, params, mesh) if params else model
        (many_loss, many_router), many_grads = eqx.filter_jit(split)(
            model, jax.device_put(tokens, placed), None if segments is None else jax.device_put(segments, placed)
        )
    worst, worst_path = 0.0, None
    one_leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(one_grads, eqx.is_array))[0]
    many_leaves = jax.tree.leaves(eqx.filter(many_grads, eqx.is_array))
    for (path, a), b in zip(one_leaves, many_leaves):
        scale = float(jnp.max(jnp.abs(a)))
        if scale == 0.0:
            continue
        ratio = float(jnp.max(jnp.abs(a - b))) / scale
        if ratio > worst:
            worst, worst_path = ratio, jax.tree_util.keystr(path)
    return {
        "type": config.type,
        "loss_one": float(one_loss),
        "loss_split": float(many_loss),
        "grad_rel_diff": worst,
        "worst_grad": worst_path,
        "grads": len(one_leaves),
        "packed": segments is not None,
        # a mixture of experts' router terms (moe/load_balancing_loss, moe/router_z_loss), each
        # on one device and split
        "router": {name: (float(one_router[name]), float(many_router[name])) for name in one_router},
    }


def main(out_path: str, layout: str, *configs: str) -> None:
    n = jax.device_count()
    results = {}
    for given in configs:
        own, _, path = given.rpartition("@")
        name = f"{own}@{os.path.basename(path)}" if own else os.path.basename(path)
        results[name] = compare(path, own or layout)
        print(name, results[name], flush=True)
    with open(out_path, "w") as f:
        json.dump({"devices": n, "results": results}, f)


if __name__ == "__main__":
    ensure_collective_threads()  # run by hand with XLA_FLAGS alone: before JAX's backend starts
    main(*sys.argv[1:])
