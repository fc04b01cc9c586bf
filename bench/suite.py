"""The benchmark suite: one command, every speed figure of issue 8, for each model.

For each model preset (``reference_gpt2.PRESETS``: the GPT-2 reference and a Llama of the same
size by default), it runs

1. **throughput**: ``bench/reference_gpt2.py --model M`` in its own process (so its peak memory
   and JAX state are its own): steady-state tokens/s, step time, model FLOPs per token, and the
   matmul rate of the same machine measured in the same run, giving MFU (on GPU against a bf16
   matmul);
2. **one core**: on a CPU machine, the same throughput run again with the process pinned to one
   core, training and yardstick alike (the peer's figure in REFERENCE.md has a one-core
   yardstick);
3. **start-up**: the real CLI, ``levanter train`` on the same config written as YAML (a few
   steps), twice: *cold* with an empty JAX compilation cache and token cache, then *warm* with
   both filled by the cold run. Each is timed from the subprocess's start to the moment the first
   step's line appears in the run's ``metrics.jsonl``.

It prints one table (rows = figures, columns = models) and writes every figure as JSON.

    .venv/bin/python bench/suite.py [--steps 60] [--models gpt2,llama] [--out bench/last-suite.json] [--workdir DIR]

``--models llama350m`` is the ~350M-parameter Llama at seq_len 2048 in bf16, for one GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

import reference_gpt2  # noqa: E402  (the presets, the run's config, MetricsWatcher)

STARTUP_STEPS = 3
"""Steps of each start-up run: enough for the first step's metrics line to be written."""

CACHE_LOG = re.compile(
    r"(Persistent compilation cache hit|PERSISTENT COMPILATION CACHE MISS) for '([^']*)' with key '([^']*)'"
)
"""The lines JAX's compiler logs at DEBUG for each lookup in the persistent compilation cache."""

JAX_CACHE_LOGGING = {"JAX_LOGGING_LEVEL": "WARNING", "JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}
"""Makes JAX log each persistent-cache hit and miss. JAX prints its per-module debug lines only
when the ``jax`` logger has a level above DEBUG, hence ``JAX_LOGGING_LEVEL=WARNING`` too."""


# -- throughput (in-process, through reference_gpt2.benchmark) --------------------------------


def throughput(model: str, steps: int, workdir: str, max_files: int | None, *, one_core: bool = False) -> dict:
    """Run ``reference_gpt2.py --model MODEL`` in its own process in ``workdir``; its figures.
    ``one_core``: the process (training and matmul yardstick alike) may use only the first CPU."""
    label = f"{model}-one-core" if one_core else model
    out = os.path.join(workdir, f"{label}-throughput.json")
    command = [
        sys.executable,
        os.path.join(BENCH, "reference_gpt2.py"),
        "--model",
        model,
        "--steps",
        str(steps),
        "--workdir",
        workdir,
        "--out",
        out,
    ]
    if max_files:
        command += ["--max-files", str(max_files)]
    log = os.path.join(workdir, f"{label}-throughput.log")
    pin = (lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})) if one_core else None
    with open(log, "w", encoding="utf-8") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, check=False, preexec_fn=pin).returncode
    if code != 0:
        raise SystemExit(f"the {model} throughput run failed (exit {code}); its output: {log}\n{tail(log)}")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


# -- start-up of the real CLI -----------------------------------------------------------------


def levanter_script() -> str:
    """The ``levanter`` console script of this Python's environment."""
    path = os.path.join(os.path.dirname(sys.executable), "levanter")
    if not os.path.exists(path):
        raise SystemExit(f"no `levanter` script beside {sys.executable}: install levanter-core there (make setup)")
    return path


def startup(model: str, workdir: str, tokenizer_path: str, max_files: int | None) -> dict:
    """Time ``levanter train`` from its start to the first step, cold then warm, in
    ``workdir/startup-MODEL`` (emptied first, so the cold run really starts cold)."""
    home = os.path.join(workdir, f"startup-{model}")
    shutil.rmtree(home, ignore_errors=True)
    os.makedirs(home)
    jax_cache = os.path.join(home, "jax-cache")
    return {
        "steps": STARTUP_STEPS,
        "jax_compilation_cache_dir": jax_cache,
        "cold": start_once(model, home, tokenizer_path, max_files, "cold", jax_cache),
        "warm": start_once(model, home, tokenizer_path, max_files, "warm", jax_cache),
    }


def start_once(model: str, home: str, tokenizer_path: str, max_files: int | None, label: str, jax_cache: str) -> dict:
    """One ``levanter train`` run of ``STARTUP_STEPS`` steps with run id ``startup-LABEL``: seconds
    from the subprocess's start to the first step's metrics line, its exit code and peak memory,
    and what the persistent compilation cache did (hits and misses that JAX logged, and the
    cache's entries before and after)."""
    import yaml

    run_id = f"startup-{label}"
    config = reference_gpt2.train_config(home, tokenizer_path, STARTUP_STEPS, run_id, model=model, max_files=max_files)
    config["trainer"]["jax_compilation_cache_dir"] = jax_cache
    config_path = os.path.join(home, f"{run_id}.yaml")
    with open(config_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f, sort_keys=False)

    entries_before = cache_entries(jax_cache)
    stdout, stderr = (os.path.join(home, f"{run_id}.{s}") for s in ("stdout", "stderr"))
    timed = time_to_first_step(
        [levanter_script(), "train", config_path], os.path.join(home, "logs", run_id, "metrics.jsonl"),
        stdout, stderr, env={**os.environ, **JAX_CACHE_LOGGING}, label=f"{label} start",
    )  # fmt: skip
    hits, misses = cache_lookups(stderr)
    return {
        **timed,
        "compilation_cache": {
            "hits": len(hits),
            "misses": len(misses),
            "missed": sorted(set(misses.values())),
            "entries_before": entries_before,
            "entries_after": cache_entries(jax_cache),
        },
        "config": config_path,
    }


def time_to_first_step(
    command: list[str], metrics_path: str, stdout: str, stderr: str, *, env: dict | None = None, label: str = ""
) -> dict:
    """Run ``command`` (a ``levanter train``) to its end, its output in the files ``stdout`` and
    ``stderr``: seconds from its start to the first step's line in ``metrics_path``, that step,
    the whole run's seconds and its peak memory. Exits, quoting its stderr, if it fails."""
    watcher = reference_gpt2.MetricsWatcher(metrics_path)
    watcher.start()
    with open(stdout, "w", encoding="utf-8") as out, open(stderr, "w", encoding="utf-8") as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
    watcher.stop()
    if code != 0:
        raise SystemExit(
            f"`{' '.join(command)}` ({label}) failed with exit {code}; its stderr: {stderr}\n{tail(stderr)}"
        )
    first = min(watcher.first_seen, default=None)
    return {
        "seconds_to_first_step": watcher.first_seen[first] - start if first is not None else None,
        "first_step": first,
        "wall_seconds": wall,
        "peak_rss_mib": usage.ru_maxrss / 1024,
    }


def cache_lookups(stderr_path: str) -> tuple[dict[str, str], dict[str, str]]:
    """The persistent-cache hits and misses JAX logged to ``stderr_path``, each as
    ``{cache key: jitted function's name}`` (JAX may log a line twice; keys count once)."""
    hits: dict[str, str] = {}
    misses: dict[str, str] = {}
    with open(stderr_path, encoding="utf-8", errors="replace") as f:
        for match in CACHE_LOG.finditer(f.read()):
            kind, name, key = match.groups()
            (hits if kind.startswith("Persistent") else misses)[key] = name
    return hits, misses


def cache_entries(path: str) -> int:
    """Compiled programs in the persistent compilation cache at ``path`` (its ``*-cache`` files)."""
    if not os.path.isdir(path):
        return 0
    return sum(1 for name in os.listdir(path) if name.endswith("-cache"))


def tail(path: str, lines: int = 20) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# -- the suite --------------------------------------------------------------------------------


def suite(models: list[str], steps: int, workdir: str, max_files: int | None = None) -> dict:
    """Every figure for every model in ``models``, as JSON-able data."""
    load_before = os.getloadavg()
    results = {}
    for model in models:
        measured = throughput(model, steps, workdir, max_files)
        tokenizer_path = os.path.join(workdir, "tokenizer.json")
        results[model] = {"throughput": measured, "startup": startup(model, workdir, tokenizer_path, max_files)}
        if measured["machine"]["jax_backend"] == "cpu" and len(os.sched_getaffinity(0)) > 1:
            # The peer's matmul yardstick (88 GFLOP/s, REFERENCE.md) is what one core of this
            # machine does: the same run on one core compares with it on an equal footing.
            results[model]["throughput_one_core"] = throughput(model, steps, workdir, max_files, one_core=True)
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        # The parent never starts JAX (on a GPU it would take the device's memory): the machine
        # as the first throughput run saw it.
        "machine": results[models[0]]["throughput"]["machine"],
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
        "workdir": workdir,
        "models": results,
    }


def rows(r: dict) -> list[tuple[str, str]]:
    """The table's rows for one model's results: (figure, value)."""
    t, s = r["throughput"], r["startup"]
    tps, step, mm = t["tokens_per_second"], t["step_seconds"], t["matmul_gflops"]
    cold, warm = s["cold"], s["warm"]

    def seconds(x):
        return f"{x:.1f} s" if x is not None else "n/a"

    return [
        ("model", f"{t['model']['model']['type']}, {t['model']['parameters'] / 1e6:.2f} M params"),
        ("tokens/s, median", f"{tps['median']:,.0f}"),
        ("tokens/s, min to max", f"{tps['min']:,.0f} to {tps['max']:,.0f}"),
        ("step time, median", f"{step['median']:.3f} s"),
        ("step time, min to max", f"{step['min']:.3f} to {step['max']:.3f} s"),
        ("steady-state steps", f"{t['steady_state_steps']} of {t['steps']}"),
        ("model FLOPs/token", f"{t['flops_per_token'] / 1e6:.2f} M"),
        ("model GFLOP/s", f"{t['model_gflops_per_second']:,.1f}"),
        ("matmul", f"{mm['dtype']} {mm['size']}x{mm['size']}"),
        ("matmul GFLOP/s, median", f"{mm['mean']['median']:,.1f}"),
        ("MFU", f"{t['mfu']:.1%}"),
        ("tokens/s per matmul GFLOP/s", f"{t['tokens_per_second_per_matmul_gflops']:.2f}"),
        ("start -> step 1, cold", seconds(cold["seconds_to_first_step"])),
        ("start -> step 1, warm", seconds(warm["seconds_to_first_step"])),
        (
            "warm: compile cache hits/misses",
            "{} / {}".format(warm["compilation_cache"]["hits"], warm["compilation_cache"]["misses"]),
        ),
        ("peak host memory, throughput", f"{t['peak_rss_mib']:,.0f} MiB"),
        ("peak host memory, CLI cold", f"{cold['peak_rss_mib']:,.0f} MiB"),
        ("loss, first -> last step", f"{t['loss']['first_step']:.3f} -> {t['loss']['last_step']:.3f}"),
    ] + one_core_rows(r.get("throughput_one_core"))


def one_core_rows(t: dict | None) -> list[tuple[str, str]]:
    """The rows of the run pinned to one core ("n/a" where there is none)."""
    if t is None:
        names = ("one core: tokens/s", "one core: matmul GFLOP/s", "one core: tokens/s per matmul GFLOP/s")
        return [(name, "n/a") for name in names]
    return [
        ("one core: tokens/s", f"{t['tokens_per_second']['median']:,.0f}"),
        ("one core: matmul GFLOP/s", f"{t['matmul_gflops']['mean']['median']:,.1f}"),
        ("one core: tokens/s per matmul GFLOP/s", f"{t['tokens_per_second_per_matmul_gflops']:.2f}"),
    ]


def print_table(results: dict) -> None:
    """One short table: rows = figures, columns = models; the machine and load above it."""
    m, load = results["machine"], results["load_average_1_5_15min"]
    print(
        f"{m['nproc']} x {m['cpu']}, jax {m['jax']} ({m['jax_backend']}: {', '.join(m['devices'])}); "
        f"load average (1 min) {load['before'][0]:.2f} before, {load['after'][0]:.2f} after"
    )
    models = list(results["models"])
    columns = {model: dict(rows(results["models"][model])) for model in models}
    names = [name for name, _ in rows(results["models"][models[0]])]
    first = max(len(name) for name in names)
    widths = {model: max(len(model), *(len(v) for v in columns[model].values())) for model in models}
    print(f"{'':<{first}}  " + "  ".join(f"{model:>{widths[model]}}" for model in models))
    for name in names:
        print(f"{name:<{first}}  " + "  ".join(f"{columns[model][name]:>{widths[model]}}" for model in models))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps of each throughput run (default 60)")
    parser.add_argument(
        "--models",
        default="gpt2,llama",
        help=f"comma-separated presets, from {', '.join(reference_gpt2.PRESETS)} (default gpt2,llama)",
    )
    parser.add_argument("--gpu-llama", action="store_true", help="run only llama350m (the same as --models llama350m)")
    parser.add_argument(
        "--max-files",
        type=int,
        default=None,
        help="use only the first N files of each split of the corpus (quick tests)",
    )
    parser.add_argument("--out", default="bench/last-suite.json", help="write the figures as JSON here")
    parser.add_argument(
        "--workdir",
        default=None,
        help="where tokenizer, caches, logs and checkpoints go (default: a new directory under the system temp dir)",
    )
    args = parser.parse_args(argv)
    models = ["llama350m"] if args.gpu_llama else [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in reference_gpt2.PRESETS]
    if unknown or not models:
        parser.error(f"--models {args.models!r}: unknown {unknown}; choose from {', '.join(reference_gpt2.PRESETS)}")
    if args.steps <= reference_gpt2.WARMUP_STEPS + 1:
        parser.error(f"--steps {args.steps}: need more than {reference_gpt2.WARMUP_STEPS + 1} for a steady state")
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="bench-suite-"))
    os.makedirs(workdir, exist_ok=True)

    results = suite(models, args.steps, workdir, args.max_files)
    print_table(results)
    reference_gpt2.write_json(args.out, results)


if __name__ == "__main__":
    main()
