"""The reference speed benchmark: GPT-2 (hidden 256, 4 layers) on the Python standard library.

Runs, in one process, the work that /work/shared/bench/REFERENCE.md defines and the peer
(Levanter) was measured on: train a byte-level BPE tokenizer (8,192 tokens) on the standard
library's ``.py`` files, tokenize them into the cache, and train the model through the real
training path (``validate_train_config`` -> ``run_training``). A matmul is timed through
``jax.jit`` before and after training (f32 2048x2048 on CPU, bf16 8192x8192 on GPU), so that
throughput can be compared across machines as tokens/s per matmul GFLOP/s, and MFU computed.

    .venv/bin/python bench/reference_gpt2.py [--steps 60] [--model gpt2] [--max-files N] [--save-every N]
                                             [--cold-cache] [--out bench/last.json] [--workdir DIR]

``--model`` picks the ``model:`` section (and the precision and batch that go with it) from
``PRESETS``: the GPT-2 reference (default), a Llama of the same size, the ~350M Llama for one
GPU, or a tiny GPT-2 that tests the benchmark itself in seconds.

``--save-every N`` also saves a checkpoint every N steps, as a run would, and reports what a
save costs: the seconds each one held up the training loop (the rest of the save is written
in the background), how long writing the same checkpoint synchronously takes, and its size.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()
"""When this script started: the whole command's wall time counts from here."""

import argparse  # noqa: E402  (after STARTED, so that the imports count)
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402

MATMUL_RUNS = 10
WARMUP_STEPS = 5
"""Steps left out of the steady state: the first includes compilation, the next few settle."""
VOCAB_SIZE = 8192
EOS = "<|endoftext|>"


# -- the models ----------------------------------------------------------------------------

REFERENCE_TRAINER = {"mp": "p=f32", "train_batch_size": 16}
"""Precision and batch of the reference run (REFERENCE.md)."""

_LLAMA_1B = {
    "type": "llama",
    "hidden_dim": 2048,
    "num_layers": 16,
    "num_heads": 32,
    "num_kv_heads": 8,
    "intermediate_dim": 8192,
    "seq_len": 2048,
    "tie_word_embeddings": True,
    "attn_backend": "jax",
}
"""Llama-3.2-1B's shapes with the corpus's vocabulary: the ``llama1b`` presets, which differ only in
gradient checkpointing."""

PRESETS: dict[str, dict] = {
    # The reference model of REFERENCE.md; GPT-2 ties its embeddings.
    "gpt2": {
        "model": {
            "type": "gpt2",
            "hidden_dim": 256,
            "num_layers": 4,
            "num_heads": 4,
            "seq_len": 256,
            "gradient_checkpointing": False,
            "unroll_layers": True,
        },
        "trainer": REFERENCE_TRAINER,
    },
    # A Llama of the same size: 5.31 M parameters against GPT-2's 5.32 M. Its gated MLP has
    # 3 x 256 x 704 weights per layer against GPT-2's 2 x 256 x 1024 (+ biases); 704 rather
    # than 688 also makes up for GPT-2's position embeddings. Tied embeddings, as in GPT-2, so
    # both spend the same on the output projection.
    "llama": {
        "model": {
            "type": "llama",
            "hidden_dim": 256,
            "num_layers": 4,
            "num_heads": 4,
            "num_kv_heads": 4,
            "intermediate_dim": 704,
            "seq_len": 256,
            "tie_word_embeddings": True,
            "gradient_checkpointing": False,
            "unroll_layers": True,
        },
        "trainer": REFERENCE_TRAINER,
    },
    # The GPU target of issue 8: 344 M parameters with the 8,192-token vocabulary (untied),
    # seq_len 2048, bf16 compute; attn_backend ``jax`` is cuDNN's fused attention on GPU.
    # Checkpointed layers: without, batch 16 x 2048 tokens of activations would not fit in 80 GB.
    "llama350m": {
        "model": {
            "type": "llama",
            "hidden_dim": 1024,
            "num_layers": 24,
            "num_heads": 16,
            "num_kv_heads": 16,
            "intermediate_dim": 3072,
            "seq_len": 2048,
            "attn_backend": "jax",
            "gradient_checkpointing": True,
        },
        "trainer": {"mp": "p=f32,c=bfloat16", "train_batch_size": 16},
    },
    # Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 query and 8 key/value heads, MLP 8192, tied
    # embeddings) with the corpus's 8,192-token vocabulary instead of its 128,256: 0.99 B
    # parameters. seq_len 2048, bf16 compute, f32 parameters and optimizer state; each layer's
    # input is kept and its inside recomputed in the backward pass. For one H100/H200 (issue 39).
    "llama1b": {
        "model": {**_LLAMA_1B, "gradient_checkpointing": True},
        "trainer": {"mp": "p=f32,c=bfloat16", "train_batch_size": 16},
    },
    # The same model with every activation kept for the backward pass (no recomputation): fewer
    # FLOPs on the device per step, about 60 GB of activations at batch 16 (an H200 holds them).
    "llama1b-keep": {
        "model": {**_LLAMA_1B, "gradient_checkpointing": False},
        "trainer": {"mp": "p=f32,c=bfloat16", "train_batch_size": 16},
    },
    # Not a benchmark: exercises the benchmark itself in seconds (tests use it).
    "tiny": {
        "model": {"type": "gpt2", "hidden_dim": 32, "num_layers": 1, "num_heads": 2, "seq_len": 32},
        "trainer": {"mp": "p=f32", "train_batch_size": 4},
        # A test-size yardstick too: 1/8 of the CPU's 2048^3 (26 timed calls a run), same dtype.
        "yardstick": {"size": 1024, "dtype": "float32"},
    },
}
"""Named ``model:`` sections, with the ``trainer.mp`` and ``trainer.train_batch_size`` they run with (and
the tiny one, a test-size matmul ``yardstick``)."""


# -- the tokenizer -------------------------------------------------------------------------


def train_tokenizer(source, path: str) -> None:
    """Train a byte-level BPE tokenizer with ``VOCAB_SIZE`` tokens on the training split of
    ``source`` and save it to ``path``."""
    from levanter_core.testing import train_bpe_tokenizer

    texts = (r.value for shard in source.shards("train") for r in source.records("train", shard))
    train_bpe_tokenizer((t for t in texts if isinstance(t, str)), path, vocab_size=VOCAB_SIZE, special_tokens=(EOS,))


# -- the matmul yardstick ------------------------------------------------------------------


def yardstick(model: str | None = None) -> dict:
    """The matmul that stands in for this machine's peak: f32 2048x2048 on CPU (as the peer was
    measured), bf16 8192x8192 with f32 accumulation on GPU (the rate mixed precision can reach);
    a preset's own ``yardstick`` where it has one (the tiny one that tests the benchmark)."""
    import jax

    if model is not None and "yardstick" in PRESETS[model]:
        return dict(PRESETS[model]["yardstick"])
    if jax.default_backend() == "gpu":
        return {"size": 8192, "dtype": "bfloat16"}
    return {"size": 2048, "dtype": "float32"}


def matmul_gflops(size: int, dtype: str, runs: int = MATMUL_RUNS) -> dict:
    """GFLOP/s of one ``size x size`` matmul of ``dtype`` inputs (float32 result) through
    ``jax.jit``: best and median of ``runs`` timed calls, after warm-up."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (size, size), dtype)
    b = jax.random.normal(kb, (size, size), dtype)
    matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    for _ in range(3):
        matmul(a, b).block_until_ready()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    flops = 2.0 * size**3
    return {"best": flops / min(times) / 1e9, "median": flops / statistics.median(times) / 1e9}


# -- watching the run ----------------------------------------------------------------------


class MetricsWatcher(threading.Thread):
    """Notes when the first training step's line appears in ``metrics.jsonl``, so the time to
    the first finished step can be told apart from the steady state. It stops looking then, so
    as not to take time from the steps it does not time."""

    def __init__(self, path: str, interval: float = 0.05):
        super().__init__(daemon=True)
        self.path = path
        self.interval = interval
        self.first_seen: dict[int, float] = {}
        self._finished = threading.Event()

    def run(self) -> None:
        while not self.first_seen:
            self._scan()
            if self._finished.wait(self.interval):
                self._scan()  # lines written just before stop()
                return

    def stop(self) -> None:
        self._finished.set()
        self.join()

    def _scan(self) -> None:
        if not os.path.exists(self.path):
            return
        now = time.perf_counter()
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line being written
                    continue
                if "train/loss" in record:
                    self.first_seen.setdefault(record["step"], now)


# -- the run -------------------------------------------------------------------------------


def train_config(
    workdir: str,
    tokenizer_path: str,
    steps: int,
    run_id: str,
    save_every: int | None = None,
    *,
    model: str = "gpt2",
    max_files: int | None = None,
    profile: tuple[int, int] | None = None,
) -> dict:
    """The reference run of the ``PRESETS[model]`` model as a config dict, in the shape of a
    YAML config file. ``max_files`` limits each split to its first files (for quick tests);
    ``profile``, ``(first step index, steps)``, records a JAX profiler trace of those steps."""
    if model not in PRESETS:
        raise ValueError(f"unknown model preset {model!r}; expected one of {sorted(PRESETS)}")
    keep = [{"every": save_every}] if save_every else [{"every": 10000}]
    data = {
        "type": "python_stdlib",
        "tokenizer": tokenizer_path,
        "shuffle": True,
        "cache_dir": os.path.join(workdir, "cache"),
    }
    if max_files:
        data["max_files"] = max_files
    return {
        "data": data,
        "model": dict(PRESETS[model]["model"]),
        "trainer": {
            **PRESETS[model]["trainer"],
            "num_train_steps": steps,
            # Evaluate only before the first step and after the last, as the peer did.
            "steps_per_eval": steps,
            "max_eval_batches": 2,
            "log_dir": os.path.join(workdir, "logs"),
            "id": run_id,
            "tracker": {"type": "json"},
            "checkpointer": {"base_path": os.path.join(workdir, "checkpoints"), "keep": keep},
            **(
                {
                    "profiler": True,
                    "profiler_start_step": profile[0],
                    "profiler_num_steps": profile[1],
                    "profiler_perfetto_link": True,
                }
                if profile
                else {}
            ),
        },
        "optimizer": {"type": "adam", "learning_rate": 1e-3, "weight_decay": 0.1},
    }


def copy_trace(run_dir: str, destination: str) -> str | None:
    """Copy the run's Perfetto trace (``trainer.profiler_perfetto_link``) to ``destination``."""
    import shutil

    traces = [
        os.path.join(root, name)
        for root, _, names in os.walk(os.path.join(run_dir, "profiler"))
        for name in names
        if name.startswith("perfetto_trace")
    ]
    if not traces:
        print(f"no Perfetto trace under {run_dir}/profiler", file=sys.stderr)
        return None
    os.makedirs(os.path.dirname(os.path.abspath(destination)), exist_ok=True)
    shutil.copyfile(max(traces, key=os.path.getmtime), destination)
    return destination


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def machine() -> dict:
    import jax

    return {
        "nproc": os.cpu_count(),
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
    }


def device_peak_memory_gib() -> float | None:
    """The most memory the first device held at once, in GiB (None where the backend does not say)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return peak / 2**30 if peak is not None else None


def save_costs(metrics: list[dict], checkpoint: str) -> dict:
    """What the run's saves cost: seconds each held up the loop (logged by the trainer), and
    the time to write the final checkpoint's arrays again synchronously, for comparison."""
    import jax.numpy as jnp
    import tensorstore as ts

    from levanter_core.checkpoint import read_metadata, write_checkpoint

    blocked = [m["checkpoint/save_blocked_seconds"] for m in metrics if "checkpoint/save_blocked_seconds" in m]
    arrays = {}
    for leaf in read_metadata(checkpoint)["leaves"]:
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(checkpoint, leaf["name"])}}
        arrays[leaf["name"].replace("/", ".")] = jnp.asarray(ts.open(spec).result().read().result())
    start = time.perf_counter()
    write_checkpoint(arrays, checkpoint + "-rewritten", step=0)
    synchronous = time.perf_counter() - start
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(checkpoint) for f in files)
    return {
        "saves": len(blocked),
        "blocked_seconds": summarize(blocked) if blocked else None,
        "synchronous_write_seconds": synchronous,
        "checkpoint_mib": size / 2**20,
        "state_mib": sum(a.nbytes for a in arrays.values()) / 2**20,
    }


def parameter_count(config, vocab_size: int) -> int:
    """Number of parameters of ``config.model`` with ``vocab_size`` tokens, from the model's own
    code (shapes only: nothing is allocated)."""
    import jax
    import numpy as np
    from haliax import Axis

    shapes = jax.eval_shape(lambda: config.model.build(Axis("vocab", vocab_size), key=jax.random.PRNGKey(0)))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(shapes) if hasattr(leaf, "shape"))


def benchmark(
    steps: int,
    workdir: str,
    save_every: int | None = None,
    cold_cache: bool = False,
    *,
    model: str = "gpt2",
    max_files: int | None = None,
    profile: tuple[int, int] | None = None,
    profile_out: str | None = None,
) -> dict:
    """Run the reference work with the ``PRESETS[model]`` model in ``workdir`` and return every
    figure as JSON-able data. ``max_files`` limits the corpus (for quick tests)."""
    from levanter_core.config.loader import Sources
    from levanter_core.config.train import validate_train_config
    from levanter_core.data.cache import read_cache
    from levanter_core.data.pipeline import build_caches
    from levanter_core.data.source import PythonStdlibSourceConfig
    from levanter_core.data.tokenizer import load_tokenizer
    from levanter_core.run import run_training
    from levanter_core.trainer.host_memory import keep_freed_memory

    # What `levanter train` does first for trainer.keep_host_memory (on by default): before the
    # tokenizer's and JAX's threads start.
    keep_freed_memory()
    # Other processes on a 2-core machine skew every figure: record how busy it was.
    load_before = os.getloadavg()
    matmul_shape = yardstick(model)
    matmul_before = matmul_gflops(**matmul_shape)

    source = PythonStdlibSourceConfig(max_files=max_files)
    files = {split: len(source.files(split)) for split in ("train", "validation")}
    tokenizer_path = os.path.join(workdir, "tokenizer.json")
    start = time.perf_counter()
    train_tokenizer(source, tokenizer_path)
    tokenizer_seconds = time.perf_counter() - start

    run_id = f"reference-{model}-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + str(os.getpid())
    config = validate_train_config(
        train_config(
            workdir, tokenizer_path, steps, run_id, save_every, model=model, max_files=max_files, profile=profile
        ),
        Sources("bench"),
    )

    # Build the caches here, through the same code, so their time is known; the run reuses them.
    # With cold_cache the run builds them itself, in the background while the step compiles.
    cache_seconds = None
    if not cold_cache:
        start = time.perf_counter()
        for _ in build_caches(config.data, progress=False):
            pass
        cache_seconds = time.perf_counter() - start

    run_dir = os.path.join(config.trainer.log_dir, run_id)
    watcher = MetricsWatcher(os.path.join(run_dir, "metrics.jsonl"))
    watcher.start()
    training_start = time.perf_counter()
    try:
        result = run_training(config, progress=False)
    finally:
        watcher.stop()
    training_seconds = time.perf_counter() - training_start

    matmul_after = matmul_gflops(**matmul_shape)
    load_after = os.getloadavg()
    wall_seconds = time.perf_counter() - STARTED

    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        metrics = [json.loads(line) for line in f]
    train = [m for m in metrics if "train/loss" in m]
    # The step that also ran the final evaluation is slower by that evaluation, and profiled steps
    # by the tracing: not steady state.
    profiled = range(profile[0] + 1, profile[0] + profile[1] + 1) if profile else range(0)
    steady = [
        m
        for m in train
        if m["step"] > WARMUP_STEPS
        and m["step"] not in profiled
        and "throughput/tokens_per_second" in m
        and "eval/loss" not in m
    ]
    trace = copy_trace(run_dir, profile_out) if profile and profile_out else None
    if not steady:
        raise SystemExit(f"too few steps for a steady state: run more than {WARMUP_STEPS + 1} steps")
    tokens_per_step = config.trainer.train_batch_size * config.model.seq_len
    rates = [m["throughput/tokens_per_second"] for m in steady]
    step_times = [tokens_per_step / r for r in rates]

    tokens_per_second = statistics.median(rates)
    tokenizer = load_tokenizer(tokenizer_path)
    flops_per_token = config.model.flops_per_token(tokenizer.vocab_size)
    model_gflops = tokens_per_second * flops_per_token / 1e9
    matmul = {k: (matmul_before[k] + matmul_after[k]) / 2 for k in ("best", "median")}
    evals = {m["step"]: m["eval/loss"] for m in metrics if "eval/loss" in m}
    first_step_seen = watcher.first_seen.get(train[0]["step"]) if train else None

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "machine": machine(),
        "load_average_1_5_15min": {"before": load_before, "after": load_after},
        "workdir": workdir,
        "run_dir": run_dir,
        "model": {"preset": model, **PRESETS[model], "parameters": parameter_count(config, tokenizer.vocab_size)},
        "corpus": {
            "files": files,
            "tokens": {split: read_cache(config.data.cache_path("main", split)).num_tokens for split in files},
            "vocab_size": tokenizer.vocab_size,
        },
        "steps": len(train),
        "steady_state_steps": len(steady),
        "tokens_per_step": tokens_per_step,
        "tokens_per_second": summarize(rates),
        "step_seconds": summarize(step_times),
        "flops_per_token": flops_per_token,
        "model_gflops_per_second": model_gflops,
        "matmul_gflops": {**matmul_shape, "before": matmul_before, "after": matmul_after, "mean": matmul},
        "mfu": model_gflops / matmul["median"],
        "tokens_per_second_per_matmul_gflops": tokens_per_second / matmul["median"],
        "loss": {
            "first_step": train[0]["train/loss"],
            "last_step": train[-1]["train/loss"],
            "eval_first": evals.get(0),
            "eval_last": evals.get(train[-1]["step"]),
        },
        "seconds": {
            "tokenizer_training": tokenizer_seconds,
            "cache_build": cache_seconds,
            "run_training": training_seconds,
            "run_training_to_first_step_logged": (
                first_step_seen - training_start if first_step_seen is not None else None
            ),
            "wall": wall_seconds,
        },
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "device_peak_memory_gib": device_peak_memory_gib(),
        "final_checkpoint": result.checkpoint,
        "checkpoints": save_costs(metrics, result.checkpoint) if save_every else None,
        "profile": {"steps": list(profiled), "trace": trace} if profile else None,
    }


def print_table(r: dict) -> None:
    tps, step, mm, s = r["tokens_per_second"], r["step_seconds"], r["matmul_gflops"], r["seconds"]
    first = s["run_training_to_first_step_logged"]
    rows = [
        ("machine", f"{r['machine']['nproc']} x {r['machine']['cpu']}, jax {r['machine']['jax']}"),
        (
            "load average (1 min) before/after",
            "{:.2f} / {:.2f}".format(r["load_average_1_5_15min"]["before"][0], r["load_average_1_5_15min"]["after"][0]),
        ),
        (
            "corpus",
            f"{r['corpus']['files']['train']} train + {r['corpus']['files']['validation']} validation files, "
            f"{r['corpus']['tokens']['train']:,} train tokens",
        ),
        (
            "model",
            f"{r['model']['preset']} ({r['model']['model']['type']}), "
            f"{r['model']['parameters'] / 1e6:.2f} M parameters",
        ),
        ("steps", f"{r['steps']} ({r['steady_state_steps']} in the steady state)"),
        ("tokens/s", f"{tps['median']:,.0f} median ({tps['min']:,.0f} to {tps['max']:,.0f})"),
        ("step time", f"{step['median']:.3f} s median ({step['min']:.3f} to {step['max']:.3f})"),
        ("model FLOPs/token", f"{r['flops_per_token'] / 1e6:.2f} M"),
        ("model GFLOP/s", f"{r['model_gflops_per_second']:.1f}"),
        (
            f"{mm['dtype']} {mm['size']}x{mm['size']} matmul GFLOP/s (median)",
            f"{mm['mean']['median']:.1f} (before {mm['before']['median']:.1f}, after {mm['after']['median']:.1f})",
        ),
        ("matmul GFLOP/s (best)", f"{mm['mean']['best']:.1f}"),
        ("MFU", f"{r['mfu']:.1%}"),
        ("tokens/s per matmul GFLOP/s", f"{r['tokens_per_second_per_matmul_gflops']:.1f} (peer: 17.9)"),
        ("loss first -> last step", f"{r['loss']['first_step']:.3f} -> {r['loss']['last_step']:.3f}"),
        ("tokenizer training", f"{s['tokenizer_training']:.1f} s"),
        (
            "cache build",
            f"{s['cache_build']:.1f} s" if s["cache_build"] is not None else "during run_training (--cold-cache)",
        ),
        ("run_training start -> step 1 logged", f"{first:.1f} s" if first is not None else "n/a"),
        ("run_training", f"{s['run_training']:.1f} s"),
        ("wall, whole command", f"{s['wall']:.1f} s"),
        ("peak host memory", f"{r['peak_rss_mib']:,.0f} MiB"),
    ]
    if r["checkpoints"]:
        c = r["checkpoints"]
        rows += [
            (
                "checkpoints saved during training",
                f"{c['saves']} (state {c['state_mib']:.1f} MiB, {c['checkpoint_mib']:.1f} MiB on disk)",
            ),
            (
                "training loop held up per save",
                "{:.3f} s median ({:.3f} to {:.3f})".format(
                    c["blocked_seconds"]["median"], c["blocked_seconds"]["min"], c["blocked_seconds"]["max"]
                ),
            ),
            ("the same save written synchronously", f"{c['synchronous_write_seconds']:.3f} s"),
        ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument(
        "--model", default="gpt2", choices=sorted(PRESETS), help="the model preset (default gpt2, the reference)"
    )
    parser.add_argument(
        "--max-files",
        type=int,
        default=None,
        help="use only the first N files of each split of the corpus (quick tests)",
    )
    parser.add_argument(
        "--save-every", type=int, default=None, help="save a checkpoint every N steps and report what saving costs"
    )
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="FIRST:STEPS",
        help="record a JAX profiler trace of STEPS steps from step index FIRST (left out of the figures)",
    )
    parser.add_argument("--profile-out", default=None, help="copy the profile's Perfetto trace (.json.gz) here")
    parser.add_argument(
        "--cold-cache",
        action="store_true",
        help="let the run build the token caches itself (in the background, while compiling)",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="where the tokenizer, cache, logs and checkpoints go (default: a new directory under the system temp dir)",
    )
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix=f"reference-{args.model}-")
    os.makedirs(workdir, exist_ok=True)

    profile = tuple(int(n) for n in args.profile.split(":")) if args.profile else None
    results = benchmark(
        args.steps,
        workdir,
        args.save_every,
        args.cold_cache,
        model=args.model,
        max_files=args.max_files,
        profile=profile,
        profile_out=args.profile_out,
    )
    print_table(results)
    if args.out:
        write_json(args.out, results)


def write_json(path: str, results: dict) -> None:
    """Write ``results`` to ``path`` (creating its directory) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
