"""``levanter plan``'s memory against what a run allocates (issue 38): small Llamas on 1, 2, 4 and
8 simulated CPU devices, under several gradient-checkpointing policies.

    .venv/bin/python bench/plan_memory.py [--devices 1 2 4 8] [--policies false true nested] [--out FILE.json]

Each case runs in a process of its own with that many devices, and does two things there:

1. the plan (``levanter_core.plan.command.plan_config``): the step compiled from shapes alone;
   its predicted peak per device;
2. the run: the state created for real (``Trainer.init_state``), the step compiled, run once
   (the runtime's own first allocations), then run again with the process's peak resident
   memory reset (``/proc/self/clear_refs``) and read after (``VmHWM``). What the devices hold is
   the state's arrays, known exactly (``jax.live_arrays``), plus what the step allocates on top,
   the rise of the peak above the resident memory before the step; divided by the devices.

JAX's CPU devices share the process's memory, and report no memory statistics of their own, so
the process's peak is the measurement; the model is sized so that a step's temporaries (tens of
MB a device) dwarf the process's other allocations during a step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "config", "llama_nano.yaml")
OVERRIDES = ["--trainer.train_batch_size", "32", "--model.seq_len", "512", "--data.cache_dir", "{work}/cache"]
"""The nano Llama (0.8 M parameters) at 32 x 512 tokens a step: the activations, not the weights,
are what the policies change."""


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def child(policy: str) -> dict:
    """In a process with the devices: the plan, then the measured step."""
    import jax
    import numpy as np
    from haliax import Axis

    from levanter_core.config.train import load_train_config
    from levanter_core.data.dataset.stream import _assemble
    from levanter_core.plan.command import plan_config
    from levanter_core.plan.estimate import host_accelerator
    from levanter_core.run.initial import build_objective
    from levanter_core.run.setup import batch_for_devices
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer

    work = tempfile.mkdtemp(prefix="plan-memory-")
    overrides = [o.format(work=work) for o in OVERRIDES] + ["--model.gradient_checkpointing", policy]
    config, _ = load_train_config(CONFIG, overrides)
    plan = plan_config(config, host_accelerator())

    config = batch_for_devices(config)
    Vocab = Axis("vocab", plan["vocab_size"])
    mesh = make_mesh(config.trainer)
    trainer = Trainer(
        config.trainer, config.optimizer.build_for_trainer(10), build_objective(config, config.model), mesh=mesh
    )
    key = jax.random.PRNGKey(0)
    state = trainer.init_state(lambda k: config.model.build(Vocab, key=k), key)
    template = _assemble(trainer.Batch.size, config.train_length, [], False, {})
    rng = np.random.default_rng(0)
    template.tokens[:] = rng.integers(0, Vocab.size, template.tokens.shape)
    trainer.compile_ahead(state, template)
    state, metrics = trainer.train_step(state, template)
    jax.block_until_ready((state, metrics))

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)  # freed memory back to the system, so that the step's allocations show
    held = sum(shard.data.nbytes for array in jax.live_arrays() for shard in array.addressable_shards)
    before = _status_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    state, metrics = trainer.train_step(state, template)
    jax.block_until_ready((state, metrics))
    peak = _status_kib("VmHWM") * 1024
    devices = jax.device_count()
    measured = (held + peak - before) / devices
    return {
        "devices": devices,
        "policy": policy,
        "predicted_peak": plan["memory"]["peak"],
        "predicted": plan["memory"],
        "held_bytes": held,
        "rss_before": before,
        "rss_peak": peak,
        "measured_peak": measured,
        "ratio": plan["memory"]["peak"] / measured,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--policies", nargs="*", default=["false", "true", "nested"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.child)), flush=True)
        return

    sys.path.insert(0, REPO)
    from levanter_core.testing import simulated_devices

    rows = []
    for devices in args.devices:
        for policy in args.policies:
            env = {**os.environ, **simulated_devices(devices)}
            done = subprocess.run(
                [sys.executable, __file__, "--child", policy], env=env, capture_output=True, text=True, check=False
            )
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"the case of {devices} devices, policy {policy}, failed")
            row = json.loads(line[len("RESULT ") :])
            rows.append(row)
            print(
                f"{devices} devices, gradient_checkpointing {policy:>6}: predicted {row['predicted_peak'] / 2**20:8.1f} MiB, "
                f"measured {row['measured_peak'] / 2**20:8.1f} MiB a device ({row['ratio'] - 1:+.1%})",
                flush=True,
            )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
