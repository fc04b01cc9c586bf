"""Pipeline parallelism on simulated CPU devices: what it saves and what it costs.

A small Llama (8 layers) and its Adam training step (loss, gradients, update), compiled on one
device and with the layers split into ``S`` = 2, 4 and 8 stages over as many devices (each in
its own process: JAX fixes the device count when it starts), the batch fed in ``M``
microbatches (the default: up to ``4 x S``), in GPipe's schedule; then, where the rows run
short (``M = S``), GPipe's schedule beside the circular one of ``R`` = 2 and 4 rounds. Per
device: the bytes of the step's arguments (parameters, Adam's two moments, the batch) and its
temporary memory from XLA's memory analysis, the bytes of the layers' weights held, and the
bytes of the collectives read from the compiled HLO, beside docs/parallelism.md's formulas for
the activations passed between stages and the chunks of a circular schedule moved to their
stages; the bubble ``(S - 1) / (R M + S - 1)``. Each pipelined step also runs (the second run
timed: on simulated devices that share the host's cores, a stage in the bubble computes
something useless rather than idling, so the bubble shows as time), and its loss is set beside
one device's.

::

    .venv/bin/python bench/pipeline_parallel.py --out bench/pipeline-parallel.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from context_parallel import collectives


def pipeline_collectives(hlo: str) -> dict[str, dict[str, int]]:
    """Bytes each kind of collective produces per device, split into those inside the pipeline's
    loop (``in_loop``: per step of the loop, as the HLO writes its body once) and the rest
    (``outside``: once per training step)."""
    totals: dict[str, dict[str, int]] = {"in_loop": {}, "outside": {}}
    for line, kind, size in collectives(hlo):
        where = "in_loop" if "scan(pipeline_step)" in line and "while/body" in line else "outside"
        totals[where][kind] = totals[where].get(kind, 0) + size
    return totals


LLAMA = {
    "type": "llama",
    "hidden_dim": 128,
    "intermediate_dim": 512,
    "num_layers": 8,
    "num_heads": 4,
    "num_kv_heads": 2,
    "gradient_checkpointing": True,
}
ROWS, SEQ_LEN, VOCAB = 16, 256, 256


def child() -> dict:
    """In a process with the devices set: compile and run the step; report."""
    import equinox as eqx
    import haliax as hax
    import jax
    import numpy as np
    import optax
    from haliax import Axis
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from levanter_core.config.base import validate_section
    from levanter_core.layers.parallel import parallel_settings
    from levanter_core.layers.pipeline import bubble_fraction, default_microbatches
    from levanter_core.models.lm import LmExample, lm_loss_and_metrics

    stages = jax.device_count()
    repeats = int(os.environ.get("PIPELINE_REPEATS", "1"))
    microbatches = int(os.environ.get("PIPELINE_MICROBATCHES", "0")) or (
        default_microbatches(stages, ROWS) if stages > 1 else 1
    )
    config = validate_section("model", {**LLAMA, "seq_len": SEQ_LEN})
    model = config.build(Axis("vocab", VOCAB), key=jax.random.PRNGKey(0))
    Batch, Pos = Axis("batch", ROWS), Axis("position", SEQ_LEN)
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (ROWS, SEQ_LEN), 0, VOCAB))
    mesh = Mesh(np.asarray(jax.devices()), ("stage",))
    mapping = {"layers": "stage"} if stages > 1 else {}
    optimizer = optax.adam(1e-3)

    def step(model, opt_state, tokens):
        settings = parallel_settings(pipeline_microbatches=microbatches, pipeline_repeats=repeats)
        with hax.axis_mapping(mapping), settings:

            def loss(model):
                return lm_loss_and_metrics(model, LmExample(hax.named(tokens, (Batch, Pos))))[0]

            value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    with jax.set_mesh(mesh):
        model = hax.shard_with_axis_mapping(model, mapping, mesh) if stages > 1 else model
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
        opt_state = hax.shard_with_axis_mapping(opt_state, mapping, mesh) if stages > 1 else opt_state
        placed = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec()))
        jitted = eqx.filter_jit(step)
        started = time.perf_counter()
        compiled = jitted.lower(model, opt_state, placed).compile()
        compile_s = time.perf_counter() - started
        _, _, value = jitted(model, opt_state, placed)
        value = float(value)
        started = time.perf_counter()
        jax.block_until_ready(jitted(model, opt_state, placed))
        step_s = time.perf_counter() - started
    compiled = compiled.compiled  # equinox's wrapper of the jax.stages.Compiled
    memory = compiled.memory_analysis()
    layers = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]
              if ".layers." in jax.tree_util.keystr(path)]  # fmt: skip
    return {
        "stages": stages,
        "microbatches": microbatches,
        "repeats": repeats,
        "bubble": round(bubble_fraction(stages, microbatches, repeats), 4),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "layer_weight_bytes": int(sum(leaf.addressable_shards[0].data.nbytes for leaf in layers)),
        "collective_bytes": pipeline_collectives(compiled.as_text()),
        "loss": value,
        "compile_s": round(compile_s, 1),
        "step_s": round(step_s, 2),
    }


def expected_permute(stages: int, microbatches: int) -> int:
    """docs/parallelism.md's formula, per device for one step of the pipeline's loop: a
    microbatch's activations (``B / M x P x D``, f32) passed on to the next stage in the forward
    pass, and their gradient passed back in the backward pass."""
    if stages == 1:
        return 0
    return 2 * (ROWS // microbatches) * SEQ_LEN * LLAMA["hidden_dim"] * 4


def expected_all_to_all(stages: int, repeats: int, layer_weight_bytes: int) -> int:
    """docs/parallelism.md's formula, per device per training step, for a circular schedule:
    each device sends every stage ``ceil(R / S)`` chunks of ``L / (S R)`` layers (padded to as
    many for every pair) in the forward pass and their gradients back; ``layer_weight_bytes``
    is what one device holds (``L / S`` layers)."""
    if repeats == 1:
        return 0
    per_chunk = layer_weight_bytes // repeats
    return 2 * stages * -(-repeats // stages) * per_chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child()))
        return
    rows = []
    layouts = [(1, 0, 1), (2, 0, 1), (4, 0, 1), (8, 0, 1)]  # (stages, microbatches (0: default), rounds)
    layouts += [(2, 2, 1), (2, 2, 2), (2, 2, 4), (4, 4, 1), (4, 4, 2)]
    for stages, microbatches, repeats in layouts:
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={stages}",
            "PIPELINE_MICROBATCHES": str(microbatches),
            "PIPELINE_REPEATS": str(repeats),
        }
        done = subprocess.run(
            [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=False
        )
        if done.returncode:
            sys.exit(done.stderr[-4000:])
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["expected_permute_bytes"] = expected_permute(stages, row["microbatches"])
        row["expected_all_to_all_bytes"] = expected_all_to_all(stages, repeats, row["layer_weight_bytes"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"model": LLAMA, "rows": ROWS, "seq_len": SEQ_LEN, "measured": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
