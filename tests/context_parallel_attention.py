"""Attention with the positions split over simulated CPU devices, beside the same attention on one
device: the outputs and the gradients of the queries, keys, values and sinks, for each kind of
attention the families use. Run by tests/test_context_parallel.py in a subprocess whose
environment sets the number of devices::

    python tests/context_parallel_attention.py OUT.json

``OUT.json`` gets, per case and strategy, the largest absolute difference of the output and of
each gradient from the one-device computation, and that computation's largest magnitude.
"""

from __future__ import annotations

import json
import sys

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis
from jax.sharding import Mesh

from levanter_core.layers.attention import AttentionMask, dot_product_attention
from levanter_core.layers.context_parallel import context_attention

Batch, Pos, KeyPos = Axis("batch", 2), Axis("position", 64), Axis("key_position", 64)
Head = Axis("head_size", 8)
MAPPING = {"batch": "data", "position": "context"}
"""The rows over the data axis, the positions over the context axis (keys follow positions)."""

CASES = {
    # name: (query head axes, key head axes, options)
    "multi-head": ((Axis("heads", 2),), (Axis("heads", 2),), {}),
    "grouped-query": ((Axis("kv_heads", 2), Axis("q_heads_per_group", 2)), (Axis("kv_heads", 2),), {}),
    "packed": ((Axis("kv_heads", 2), Axis("q_heads_per_group", 2)), (Axis("kv_heads", 2),), {"segments": True}),
    "sliding-window": ((Axis("heads", 2),), (Axis("heads", 2),), {"window": 12, "segments": True}),
    "window-switched-off": ((Axis("heads", 2),), (Axis("heads", 2),), {"window": 12, "sliding": False}),
    "sinks": ((Axis("kv_heads", 1), Axis("q_heads_per_group", 2)), (Axis("kv_heads", 1),), {"sinks": True}),
    "soft-cap": ((Axis("heads", 2),), (Axis("heads", 2),), {"soft_cap": 5.0}),
    "latent": ((Axis("heads", 2),), (Axis("heads", 2),), {"v_head": 12}),
}


def inputs(q_heads, k_heads, options, key):
    kq, kk, kv, ks, kseg = jax.random.split(key, 5)
    VHead = Head.resize(options["v_head"]).alias("v_head_size") if "v_head" in options else Head
    q = hax.random.normal(kq, (Batch, Pos, *q_heads, Head))
    k = hax.random.normal(kk, (Batch, KeyPos, *k_heads, Head))
    v = hax.random.normal(kv, (Batch, KeyPos, *k_heads, VHead))
    sinks = hax.random.normal(ks, q_heads) if options.get("sinks") else None
    mask = AttentionMask.causal_mask()
    if options.get("segments"):
        # documents of random lengths packed into each row
        starts = jax.random.bernoulli(kseg, 0.08, (Batch.size, Pos.size)).astype(jnp.int32)
        mask = mask.with_segments(hax.named(jnp.cumsum(starts, axis=1), (Batch, Pos)))
    return q, k, v, sinks, mask, VHead


def attention(q, k, v, sinks, mask, VHead, options):
    return dot_product_attention(
        q, k, v, mask, Pos=Pos, KeyPos=KeyPos, HeadSize=Head, scale=Head.size**-0.5,
        soft_cap=options.get("soft_cap"), window=options.get("window"),
        sliding=jnp.asarray(options["sliding"]) if "sliding" in options else None,
        backend="reference", sinks=sinks, VHeadSize=VHead if VHead != Head else None,
    )  # fmt: skip


def output_and_grads(q, k, v, sinks, mask, VHead, options):
    def loss(q, k, v, sinks):
        out = attention(q, k, v, sinks, mask, VHead, options)
        weights = hax.arange(out.axes[-1]).astype(jnp.float32) + 1.0  # every output dim counts differently
        return hax.sum(out * weights).array, out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    return out, grads


def main(out_path: str) -> None:
    n = jax.device_count()
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, n // 2), ("data", "context"))
    results = {}
    for name, (q_heads, k_heads, options) in CASES.items():
        args = inputs(q_heads, k_heads, options, jax.random.PRNGKey(len(results)))
        one = jax.jit(output_and_grads, static_argnums=(5, 6))(*args[:5], args[5], _Static(options))
        for strategy in ("ring", "all_gather"):

            def split(*a, options=options, strategy=strategy):
                with hax.axis_mapping(MAPPING), context_attention(strategy):
                    return output_and_grads(*a[:5], a[5], options)

            with jax.set_mesh(mesh):
                many = jax.jit(split, static_argnums=(5,))(*args[:5], args[5])
                program = str(jax.make_jaxpr(split, static_argnums=(5,))(*args[:5], args[5]))
            leaves_one = jax.tree.leaves((one[0], one[1]))
            leaves_many = jax.tree.leaves((many[0], many[1]))
            diffs = [float(jnp.max(jnp.abs(a.array - b.array) if hasattr(a, "array") else jnp.abs(a - b)))
                     for a, b in zip(leaves_one, leaves_many)]  # fmt: skip
            scale = max(float(jnp.max(jnp.abs(getattr(a, "array", a)))) for a in leaves_one)
            collectives = sorted(c for c in ("ppermute", "all_gather") if c in program)
            results[f"{name}/{strategy}"] = {
                "max_diff": max(diffs),
                "diffs": diffs,
                "scale": scale,
                "collectives": collectives,
            }
            print(name, strategy, max(diffs), flush=True)
    with open(out_path, "w") as f:
        json.dump({"devices": n, "results": results}, f)


class _Static(dict):
    """Options as a static (hashable) argument of jit."""

    def __hash__(self):  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


if __name__ == "__main__":
    main(*sys.argv[1:])
