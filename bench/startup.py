"""Start-up of the main job: seconds from ``levanter train config/gpt2_nano.yaml`` to its first step.

Runs the README's main job (a few steps) twice in a fresh work directory: *cold*, with an empty
JAX compilation cache and no token cache, then *warm*, with both filled by the cold run. Each
time is measured from the command's start to the moment the first step's line appears in the
run's ``metrics.jsonl``.

    .venv/bin/python bench/startup.py [--config config/gpt2_nano.yaml] [--steps 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

from suite import levanter_script, time_to_first_step  # noqa: E402


def start(config: str, workdir: str, steps: int, label: str) -> dict:
    """One run of ``levanter train CONFIG`` with its logs, checkpoints, token cache and JAX
    compilation cache in ``workdir``: seconds to the first step, the whole run's, its peak memory."""
    run_id = f"startup-{label}"
    overrides = {
        "trainer.num_train_steps": steps, "trainer.id": run_id, "trainer.log_dir": f"{workdir}/logs",
        "trainer.checkpointer.base_path": f"{workdir}/checkpoints", "data.cache_dir": f"{workdir}/cache",
        "trainer.jax_compilation_cache_dir": f"{workdir}/jax-cache",
    }  # fmt: skip
    command = [levanter_script(), "train", config, "--no-progress"]
    for name, value in overrides.items():
        command += [f"--{name}", str(value)]
    metrics = os.path.join(workdir, "logs", run_id, "metrics.jsonl")
    stdout, stderr = (os.path.join(workdir, f"{run_id}.{s}") for s in ("stdout", "stderr"))
    return time_to_first_step(command, metrics, stdout, stderr, label=f"{label} start")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(os.path.dirname(BENCH), "config", "gpt2_nano.yaml"))
    parser.add_argument("--steps", type=int, default=3, help="steps of each run (default 3)")
    parser.add_argument("--workdir", default=None, help="default: a new directory under the system temp dir")
    args = parser.parse_args(argv)
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="startup-"))
    results = {label: start(os.path.abspath(args.config), workdir, args.steps, label) for label in ("cold", "warm")}
    for label, r in results.items():
        first = r["seconds_to_first_step"]
        shown = f"{first:.1f} s after the command's start" if first is not None else "never logged"
        print(f"{label}: first step {shown} (whole run {r['wall_seconds']:.1f} s, {r['peak_rss_mib']:,.0f} MiB)")
    print(json.dumps({"config": args.config, **results}))


if __name__ == "__main__":
    main()
