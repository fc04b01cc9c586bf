"""Expert parallelism on simulated CPU devices: what it saves and what it costs.

A small Mixtral (8 experts of 2 chosen per token, 2 layers) and its Adam training step (loss,
gradients, update), compiled on one device and with the experts split over ``N`` = 2, 4 and 8
devices (each in its own process: JAX fixes the device count when it starts). Per device: the
bytes of the step's arguments (parameters, Adam's two moments, the batch) and its temporary
memory from XLA's memory analysis, the bytes of the experts' weights held, and the bytes of the
``all-to-all`` s read from the compiled HLO beside docs/parallelism.md's formula, for the
dropless exchange and with a capacity factor of 1.25. Each split step also runs once, and its
loss is set beside one device's.

::

    .venv/bin/python bench/expert_parallel.py --out bench/expert-parallel.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from context_parallel import collective_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXTRAL = {
    "type": "mixtral",
    "hidden_dim": 128,
    "intermediate_dim": 256,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "gradient_checkpointing": False,
}
ROWS, SEQ_LEN, VOCAB = 8, 256, 256


def child(capacity: float | None) -> dict:
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
    from levanter_core.models.lm import LmExample, lm_loss_and_metrics

    n = jax.device_count()
    config = validate_section("model", {**MIXTRAL, "seq_len": SEQ_LEN})
    model = config.build(Axis("vocab", VOCAB), key=jax.random.PRNGKey(0))
    Batch, Pos = Axis("batch", ROWS), Axis("position", SEQ_LEN)
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (ROWS, SEQ_LEN), 0, VOCAB))
    mesh = Mesh(np.asarray(jax.devices()), ("expert",))
    compute = {"batch": "expert", "experts": "expert"} if n > 1 else {}
    params_mapping = {"experts": "expert"} if n > 1 else {}
    optimizer = optax.adam(1e-3)

    def step(model, opt_state, tokens):
        with hax.axis_mapping(compute), parallel_settings(expert_capacity_factor=capacity):

            def loss(model):
                return lm_loss_and_metrics(model, LmExample(hax.named(tokens, (Batch, Pos))))[0]

            value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    with jax.set_mesh(mesh):
        model = hax.shard_with_axis_mapping(model, params_mapping, mesh) if n > 1 else model
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
        opt_state = hax.shard_with_axis_mapping(opt_state, params_mapping, mesh) if n > 1 else opt_state
        placed = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec("expert" if n > 1 else None)))
        jitted = eqx.filter_jit(step)
        started = time.perf_counter()
        compiled = jitted.lower(model, opt_state, placed).compile()
        compile_s = time.perf_counter() - started
        started = time.perf_counter()
        _, _, value = jitted(model, opt_state, placed)
        value = float(value)
        step_s = time.perf_counter() - started
    compiled = compiled.compiled  # equinox's wrapper of the jax.stages.Compiled
    memory = compiled.memory_analysis()
    experts = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]
               if "experts" in jax.tree_util.keystr(path) and "shared" not in jax.tree_util.keystr(path)]  # fmt: skip
    expert_bytes = sum(leaf.addressable_shards[0].data.nbytes for leaf in experts)
    return {
        "devices": n,
        "capacity_factor": capacity,
        "argument_bytes": int(memory.argument_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "expert_weight_bytes": int(expert_bytes),
        "collective_bytes": collective_bytes(compiled.as_text()),
        "loss": value,
        "compile_s": round(compile_s, 1),
        "step_s": round(step_s, 2),
    }


def expected_all_to_all(n: int, capacity: float | None) -> int:
    """docs/parallelism.md's formula, as the compiled step's all-to-alls produce it per device for
    one layer (the HLO holds the scanned layer's body once): forward the rows (``N x C x D``),
    their experts' numbers (``N x C``, int32) and the results (``N x C x D``); backward the rows'
    and the results' gradients (``2 N C D``)."""
    if n == 1:
        return 0
    pairs = ROWS * SEQ_LEN // n * MIXTRAL["num_experts_per_tok"]
    c = pairs if capacity is None else max(1, min(pairs, math.ceil(capacity * pairs / n)))
    d = MIXTRAL["hidden_dim"]
    return 4 * n * c * d * 4 + n * c * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=float, default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.capacity)))
        return
    rows = []
    for devices, capacity in [(1, None), (2, None), (4, None), (8, None), (8, 1.25)]:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        command = [sys.executable, __file__, "--child"] + ([] if capacity is None else ["--capacity", str(capacity)])
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(done.stderr[-4000:])
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["expected_all_to_all_bytes"] = expected_all_to_all(devices, capacity)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"model": MIXTRAL, "rows": ROWS, "seq_len": SEQ_LEN, "measured": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
