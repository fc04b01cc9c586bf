"""Step time of the reference model (bench/reference_gpt2.py) on 1, 2, 4 and 8 simulated CPU
devices, with FSDP over all of them (``fsdp_axis: embed``, ``model_axis_size: 1``).

The tokenizer and the token caches are made once; then each device count trains in its own
process (``XLA_FLAGS=--xla_force_host_platform_device_count=N``), since JAX fixes the device
count when it starts. Simulated devices share the host's cores, so this measures the cost of
the sharded program (collectives, split matmuls), not a speed-up.

    .venv/bin/python bench/scaling.py [--devices 1 2 4 8] [--steps 20] [--workdir DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference_gpt2


def prepare(workdir: str) -> str:
    """Train the reference tokenizer and build the caches in ``workdir``; the tokenizer's path."""
    from levanter_core.config.loader import Sources
    from levanter_core.config.train import validate_train_config
    from levanter_core.data.pipeline import build_caches
    from levanter_core.data.source import PythonStdlibSourceConfig

    tokenizer_path = os.path.join(workdir, "tokenizer.json")
    if not os.path.exists(tokenizer_path):
        reference_gpt2.train_tokenizer(PythonStdlibSourceConfig(), tokenizer_path)
    config = validate_train_config(reference_gpt2.train_config(workdir, tokenizer_path, 1, "prepare"), Sources("bench"))
    for _ in build_caches(config.data, progress=False):
        pass
    return tokenizer_path


def measure(workdir: str, tokenizer_path: str, steps: int, devices: int) -> dict:
    """Train the reference run for ``steps`` steps on ``devices`` devices (this process's);
    the median, min and max step time after the warm-up steps."""
    import jax

    from levanter_core.config.loader import Sources
    from levanter_core.config.train import validate_train_config
    from levanter_core.run import run_training

    assert jax.device_count() == devices, (jax.device_count(), devices)
    run_id = f"scaling-{devices}-{os.getpid()}"
    raw = reference_gpt2.train_config(workdir, tokenizer_path, steps, run_id)
    config = validate_train_config(raw, Sources("bench"))
    result = run_training(config, progress=False)
    with open(os.path.join(result.run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    tokens_per_step = config.trainer.train_batch_size * config.model.seq_len
    times = [
        tokens_per_step / r["throughput/tokens_per_second"]
        for r in records
        if r["step"] > reference_gpt2.WARMUP_STEPS and "throughput/tokens_per_second" in r and "eval/loss" not in r
    ]
    if not times:
        raise SystemExit(f"too few steps for a steady state: run more than {reference_gpt2.WARMUP_STEPS + 1}")
    return {
        "devices": devices,
        "step_seconds": {"median": statistics.median(times), "min": min(times), "max": max(times)},
        "steps_timed": len(times),
        "last_loss": records[-1].get("train/loss"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=20, help="training steps per device count (default 20)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="scaling-")
    os.makedirs(workdir, exist_ok=True)
    tokenizer_path = os.path.join(workdir, "tokenizer.json")

    if args.worker is not None:  # one device count, in the process the parent started for it
        print(json.dumps(measure(workdir, tokenizer_path, args.steps, args.worker)))
        return

    prepare(workdir)
    load_before = os.getloadavg()
    results = []
    for n in args.devices:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
        command = [sys.executable, __file__, "--worker", str(n), "--steps", str(args.steps), "--workdir", workdir]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        step = results[-1]["step_seconds"]
        print(f"{n} device(s): {step['median']:.3f} s/step median ({step['min']:.3f} to {step['max']:.3f})", flush=True)
    figures = {"cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "steps": args.steps, "results": results}  # fmt: skip
    print(f"load average (1 min) before/after: {load_before[0]:.2f} / {figures['load_average_after'][0]:.2f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
