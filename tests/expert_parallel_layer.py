"""One mixture-of-experts layer with its experts split over 4 of 8 simulated CPU devices (2 data
x 4 expert), beside the same layer on one device. Run by tests/test_expert_parallel.py in a
subprocess whose environment sets 8 simulated devices::

    python tests/expert_parallel_layer.py OUT.json

``OUT.json`` gets, per routing kind and capacity factor: the loss (the sum of squares of the
layer's output plus its load-balancing statistic) split and on one device, and the largest
difference of a gradient from one device's relative to that gradient's largest magnitude, the
share of pairs the split layer reports it dropped (from the forward pass of that loss, compiled
with it) and the share counted here from its routing; the number of ``all_to_all`` s in the
split step's jaxpr; and the message of the error for 6 experts on 4 devices.
"""

from __future__ import annotations

import json
import math
import sys

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from levanter_core.layers.expert_parallel import expert_capacity
from levanter_core.layers.moe import FUSED_INTERLEAVED_EXPERTS, MoeBlock, MoeConfig

Embed, Batch, Pos = Axis("embed", 16), Axis("batch", 8), Axis("position", 6)
MAPPING = {"batch": ("data", "expert"), "experts": "expert"}
KINDS = {
    "softmax_topk": {},
    "topk_softmax, biases": {"routing": "topk_softmax", "expert_bias": True, "router_bias": True,
                             "glu_limit": 7.0, "layout": FUSED_INTERLEAVED_EXPERTS},
    "sigmoid_topk, groups, shared": {"routing": "sigmoid_topk", "correction_bias": True, "num_groups": 4,
                                     "top_groups": 2, "routed_scaling": 2.5, "shared_intermediate_dim": 8},
}  # fmt: skip


def loss(block, x):
    return loss_and_dropped(block, x)[0]


def loss_and_dropped(block, x):
    """The loss, and the share of pairs the layer reports it dropped in the same forward pass."""
    out, stats = block(x)
    value = hax.sum(out * out).scalar() + hax.sum(stats.expert_fraction * stats.mean_probability).scalar()
    return value, stats.dropped_fraction


def worst(a_tree, b_tree) -> float:
    ratios = []
    for a, b in zip(
        jax.tree.leaves(eqx.filter(a_tree, eqx.is_array)), jax.tree.leaves(eqx.filter(b_tree, eqx.is_array))
    ):
        scale = float(jnp.max(jnp.abs(a)))
        if scale:
            ratios.append(float(jnp.max(jnp.abs(a - b))) / scale)
    return max(ratios)


def expected_dropped(block, x, factor) -> float:
    """The share of pairs a capacity ``factor`` drops, counted here from one device's routing:
    the batch's rows in 8 equal parts (one per device, as MAPPING places them), each part's pairs
    per destination (4 expert devices of 2 experts) past its ``ceil(factor x pairs / 4)`` rows."""
    if factor is None:
        return 0.0
    tokens = x.flatten_axes((Batch, Pos), "token")
    chosen, _ = block.route(block.router.logits(tokens), tokens.resolve_axis("token"))
    per_device = np.asarray(chosen.array).reshape(8, -1)  # rows are (batch, position) in order
    rows = min(per_device.shape[1], max(1, math.ceil(factor * per_device.shape[1] / 4)))
    dropped = sum(np.maximum(np.bincount(part // 2, minlength=4) - rows, 0).sum() for part in per_device)
    return float(dropped / per_device.size)


def main(out_path: str) -> None:
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "expert"))
    x = hax.random.normal(jax.random.PRNGKey(1), (Batch, Pos, Embed))

    def grad(block, x):
        """(loss, dropped share reported by the forward pass that gave the loss), gradients: one
        program for all three."""

        def fresh(block, x):  # a new function, traced afresh: the capacity factor is read while tracing
            return loss_and_dropped(block, x)

        return eqx.filter_jit(eqx.filter_value_and_grad(fresh, has_aux=True))(block, x)

    results: dict = {}
    for name, settings in KINDS.items():
        block = MoeBlock.init(MoeConfig(Embed=Embed, num_experts=8, top_k=2, intermediate_dim=12, **settings),
                              key=jax.random.PRNGKey(0))  # fmt: skip
        (one_loss, _), one_grads = grad(block, x)
        for factor in (None, 1.0, 8.0):
            with jax.set_mesh(mesh), hax.axis_mapping(MAPPING), expert_capacity(factor):
                placed = jax.device_put(x.array, NamedSharding(mesh, PartitionSpec(("data", "expert"))))
                (split_loss, reported), split_grads = grad(block, hax.named(placed, x.axes))
                if factor is None and name == "softmax_topk":
                    jaxpr = str(jax.make_jaxpr(lambda b, x: eqx.filter_grad(loss)(b, x))(block, x))
                    results["all_to_all"] = jaxpr.count("all_to_all")
            results[f"{name} / {factor}"] = {
                "loss_one": float(one_loss), "loss_split": float(split_loss),
                "grad_rel_diff": worst(one_grads, split_grads),
                "dropped_reported": float(reported.array), "dropped_expected": expected_dropped(block, x, factor),
            }  # fmt: skip
    six = MoeBlock.init(MoeConfig(Embed=Embed, num_experts=6, top_k=2, intermediate_dim=12), key=jax.random.PRNGKey(0))
    try:
        with jax.set_mesh(mesh), hax.axis_mapping(MAPPING):
            grad(six, x)
        results["six_experts_error"] = None
    except ValueError as e:
        results["six_experts_error"] = str(e)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
