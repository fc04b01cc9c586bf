"""Each model family's loss and gradients with the positions of its sequences split over devices
(context parallelism), beside the same on one device, with packed documents. Run by
tests/test_context_parallel.py in a subprocess whose environment sets the number of simulated
CPU devices::

    python tests/context_parallel_families.py OUT.json STRATEGY CONFIG.yaml...

Each CONFIG.yaml is a family's nano config (its ``model:`` section is read, with 64 positions).
The mesh is 2 (data) x N/2 (context). ``OUT.json`` gets, per config: both losses, and the largest
difference of a gradient from one device's relative to that gradient's largest magnitude.
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
from levanter_core.layers.context_parallel import context_attention
from levanter_core.models.lm import LmExample, lm_loss_and_metrics

SEQ_LEN, ROWS, VOCAB = 64, 2, 128
MAPPING = {"batch": "data", "position": "context"}


def batch(key) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and the segment ids of documents of random lengths packed into each row."""
    k_tokens, k_starts = jax.random.split(key)
    tokens = np.asarray(jax.random.randint(k_tokens, (ROWS, SEQ_LEN), 0, VOCAB))
    starts = np.asarray(jax.random.bernoulli(k_starts, 0.06, (ROWS, SEQ_LEN))).astype(np.int32)
    return tokens, np.cumsum(starts, axis=1).astype(np.int32)


def loss_and_grads(model, tokens, segments):
    Batch, Pos = Axis("batch", ROWS), Axis("position", SEQ_LEN)
    packed = None if segments is None else hax.named(segments, (Batch, Pos))
    example = LmExample(hax.named(tokens, (Batch, Pos)), segment_ids=packed)

    def loss(model):
        return lm_loss_and_metrics(model, example)[0]

    return eqx.filter_value_and_grad(loss)(model)


def compare(config_path: str, mesh: Mesh, strategy: str) -> dict:
    with open(config_path) as f:
        section = dict(yaml.safe_load(f)["model"])
    section["seq_len"] = SEQ_LEN
    for heavy in ("gradient_checkpointing",):
        section.pop(heavy, None)
    config = validate_section("model", section)
    model = config.build(Axis("vocab", VOCAB), key=jax.random.PRNGKey(0))
    tokens, segments = batch(jax.random.PRNGKey(1))
    try:
        one_loss, one_grads = eqx.filter_jit(loss_and_grads)(model, tokens, segments)
    except ValueError as e:  # a family that cannot read packed documents (Hyena's convolutions)
        if "packed" not in str(e):
            raise
        segments = None
        one_loss, one_grads = eqx.filter_jit(loss_and_grads)(model, tokens, segments)

    def split(model, tokens, segments):
        with hax.axis_mapping(MAPPING), context_attention(strategy):
            return loss_and_grads(model, tokens, segments)

    placed = NamedSharding(mesh, PartitionSpec("data", "context"))
    with jax.set_mesh(mesh):
        many_loss, many_grads = eqx.filter_jit(split)(
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
    }


def main(out_path: str, strategy: str, *configs: str) -> None:
    n = jax.device_count()
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, n // 2), ("data", "context"))
    results = {}
    for path in configs:
        results[os.path.basename(path)] = compare(path, mesh, strategy)
        print(os.path.basename(path), results[os.path.basename(path)], flush=True)
    with open(out_path, "w") as f:
        json.dump({"devices": n, "results": results}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
