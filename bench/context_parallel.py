"""Context parallelism on simulated CPU devices: what it saves and what it costs.

Two parts, each in its own process (JAX fixes the device count when it starts):

* ``memory``: a small Llama's loss-and-gradient step at a long sequence, compiled on one device
  and with the positions split over ``N`` devices (ring and all-gather attention); per device, the
  temporary memory XLA's memory analysis reports and the bytes of each collective read from the
  compiled HLO, beside the formulas of docs/parallelism.md. With ``--run`` the split step also
  runs (one training step of the 32,768-token sequence: it fits where one device's would not);
  the all-gather step is compiled only (see :func:`memory`).
* ``families``: every family's loss and gradients on 2 x 4 devices (data x context) against one
  device's, with packed documents, for both attention strategies
  (tests/context_parallel_families.py).

::

    .venv/bin/python bench/context_parallel.py memory --seq-len 32768 --devices 8 --run --out bench/context-parallel-memory.json
    .venv/bin/python bench/context_parallel.py memory --seq-len 32768 --counts 2,4,8 --out bench/context-parallel-scaling.json
    .venv/bin/python bench/context_parallel.py families --out bench/context-parallel-families.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA = {
    "type": "llama",
    "hidden_dim": 64,
    "intermediate_dim": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "gradient_checkpointing": True,
}
"""A small Llama: the activations, not the weights, are what a long sequence makes large."""

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?\)?)\s+(collective-permute|all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\("
)


def collectives(hlo: str) -> Iterator[tuple[str, str, int]]:
    """Each collective instruction of the compiled module, as written (the body of a loop once):
    its line, its kind (``collective-permute``, ``all-gather``, ``all-reduce``,
    ``reduce-scatter``, ``all-to-all``) and the bytes of its output shapes per device."""
    for line in hlo.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)  # XLA's /*index=5*/ comments inside long tuples
        match = COLLECTIVE.search(line)
        if not match:
            continue
        shapes, kind = match.groups()
        size = 0
        for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", shapes):
            count = 1
            for d in dims.split(","):
                if d:
                    count *= int(d)
            size += count * DTYPE_BYTES.get(dtype, 4)
        yield line, kind, size


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes each kind of collective produces per device in one run of the compiled module
    (summed over its instructions, as written: the body of a loop, such as the scan over
    layers, counts once)."""
    totals: dict[str, int] = {}
    for _, kind, size in collectives(hlo):
        totals[kind] = totals.get(kind, 0) + size
    return totals


def memory_child(seq_len: int, strategy: str, run: bool) -> dict:
    """In a process with the devices set: compile (and optionally run) the step; report."""
    import equinox as eqx
    import haliax as hax
    import jax
    import numpy as np
    from haliax import Axis
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from levanter_core.config.base import validate_section
    from levanter_core.layers.context_parallel import context_attention
    from levanter_core.models.lm import LmExample, lm_loss_and_metrics

    n = jax.device_count()
    config = validate_section("model", {**LLAMA, "seq_len": seq_len, "flash_attention_block_size": 2048})
    model = config.build(Axis("vocab", 256), key=jax.random.PRNGKey(0))
    Batch, Pos = Axis("batch", 1), Axis("position", seq_len)
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (1, seq_len), 0, 256))

    def loss_and_grads(model, tokens):
        def loss(model):
            return lm_loss_and_metrics(model, LmExample(hax.named(tokens, (Batch, Pos))))[0]

        return eqx.filter_value_and_grad(loss)(model)

    mesh = Mesh(np.asarray(jax.devices()), ("context",))
    if n == 1:
        step, placed = jax.jit(loss_and_grads), tokens
    else:

        def split(model, tokens):
            with hax.axis_mapping({"position": "context"}), context_attention(strategy):
                return loss_and_grads(model, tokens)

        step = jax.jit(split)
        placed = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec(None, "context")))
    started = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = step.lower(model, placed)
        compiled = lowered.compile()
    compile_s = time.perf_counter() - started
    memory = compiled.memory_analysis()
    out = {
        "devices": n,
        "seq_len": seq_len,
        "strategy": strategy if n > 1 else "one device",
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "collective_bytes": collective_bytes(compiled.as_text()),
        "compile_s": round(compile_s, 1),
    }
    if run:
        started = time.perf_counter()
        with jax.set_mesh(mesh):
            loss, _ = step(model, placed)
        out["loss"] = float(loss)
        out["step_s"] = round(time.perf_counter() - started, 1)
    return out


def expected_bytes(seq_len: int, n: int, strategy: str) -> dict[str, int]:
    """docs/parallelism.md's communication of one layer's attention per device in a training step
    (forward, its recomputation under gradient checkpointing, backward), in bytes of float32, as
    :func:`collective_bytes` counts them (output sizes; a scanned layer's body appears once in
    the HLO). With ``P = S / n`` positions per device, ``B_q = P x heads x head_dim x 4`` and
    ``B_kv = P x kv_heads x head_dim x 4``:

    * ring: forward ``(n - 1)(2 B_kv + 4P)`` (keys, values and their positions around the ring)
      plus ``2 B_q + 2 B_kv`` (queries, keys, values into the zigzag layout and the output back);
      backward ``(n - 1) 2 B_kv + 2 B_q + 2 B_kv``;
    * all-gather: forward ``2 S x kv_heads x head_dim x 4`` gathered plus ``2 B_q`` (zigzag);
      backward ``2 B_kv`` reduce-scattered and ``2 B_q``."""
    head_dim = LLAMA["hidden_dim"] // LLAMA["num_heads"]
    per = seq_len // n
    b_q, b_kv = per * LLAMA["num_heads"] * head_dim * 4, per * LLAMA["num_kv_heads"] * head_dim * 4
    if strategy == "ring":
        forward = (n - 1) * (2 * b_kv + 4 * per) + 2 * b_q + 2 * b_kv
        backward = (n - 1) * 2 * b_kv + 2 * b_q + 2 * b_kv
        return {"collective-permute": 2 * forward + backward}
    gathered = 2 * seq_len * LLAMA["num_kv_heads"] * head_dim * 4
    return {"all-gather": 2 * gathered, "collective-permute": 3 * 2 * b_q, "reduce-scatter": 2 * b_kv}


def memory(args) -> dict:
    rows = []
    if args.counts:  # how the memory falls with the device count: the ring at each, compiled only
        layouts = [(1, "ring")] + [(int(n), "ring") for n in args.counts.split(",")]
    else:
        layouts = [(1, "ring"), (args.devices, "ring"), (args.devices, "all_gather")]
    for devices, strategy in layouts:
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        }
        command = [sys.executable, __file__, "memory-child", "--seq-len", str(args.seq_len), "--strategy", strategy]
        if args.run and devices > 1 and strategy == "ring":
            # one step of the split run is enough to show it runs; the other strategy's memory and
            # collectives come from its compiled step (8 simulated devices share this machine)
            command.append("--run")
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if result.returncode:
            raise SystemExit(result.stderr[-4000:])
        row = json.loads(result.stdout.strip().splitlines()[-1])
        if devices > 1:
            row["expected_collective_bytes"] = expected_bytes(args.seq_len, devices, strategy)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"part": "memory", "model": LLAMA, "rows": rows}


def families(args) -> dict:
    configs = sorted(glob.glob(f"{REPO}/plugins/models-*/levanter_model_*/configs/*_nano.yaml"))
    configs = [c for c in configs if "whisper" not in c]  # an encoder-decoder: not a language model over text
    out = {"part": "families", "strategies": {}}
    for strategy in ("ring", "all_gather"):
        path = f"/tmp/context-parallel-families-{strategy}.json"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
        result = subprocess.run(
            [sys.executable, f"{REPO}/tests/context_parallel_families.py", path, strategy, *configs],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if result.returncode:
            raise SystemExit(result.stderr[-4000:])
        with open(path) as f:
            out["strategies"][strategy] = json.load(f)["results"]
        for name, row in out["strategies"][strategy].items():
            print(strategy, name, row["loss_one"], row["loss_split"], row["grad_rel_diff"], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["memory", "families", "memory-child"])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--strategy", default="ring")
    parser.add_argument("--run", action="store_true", help="also run the split step (memory)")
    parser.add_argument(
        "--counts", help="memory: the ring on each of these device counts (e.g. 2,4,8) instead of --devices"
    )
    parser.add_argument("--out", help="write the results here (JSON)")
    args = parser.parse_args()
    if args.part == "memory-child":
        print(json.dumps(memory_child(args.seq_len, args.strategy, args.run)))
        return
    result = memory(args) if args.part == "memory" else families(args)
    result["date"] = time.strftime("%Y-%m-%d")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
