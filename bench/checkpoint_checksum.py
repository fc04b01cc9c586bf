"""What checksumming every checkpoint array costs: save and restore times of the same training
state with the checkpointer of this working tree and with that of an earlier commit (before
checksums), measured in turns on the same machine.

    .venv/bin/python bench/checkpoint_checksum.py --baseline c7ef36c --out bench/last-checksum.json

The state looks like a small GPT-2's training state (weights and both Adam moments: three
copies of each matrix, float32 random normal values, which do not compress), ``--megabytes``
in all, in a local directory (``--directory``, default a temporary one, so that restores read
from the page cache and the figures are CPU time: compression, checksums, copies).

One process per code version holds the state; they take turns (which one goes first
alternates), first ``--repeats`` turns of one synchronous save each (``write_checkpoint``: host
copy, zstd, writing, metadata and marker), then ``--repeats`` turns of one restore each
(``load_checkpoint`` into arrays on the device, until ready, of a checkpoint saved just before,
untimed, so that no version reads chunks it has cached): saves are timed apart from restores,
as a run does them (one restore when it starts, then saves). Taking turns makes
a busy machine's slow spells fall on both versions alike; the figures are the medians and
minimums over the turns. ``--baseline HEAD``
compares this tree with itself: the spread that shows is the machine's noise.

The work the checksums add is also timed alone: XXH3-64 over every byte of the state, in this
process, one thread (the least of 5), beside the baseline's median save and restore.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpt2_like_shapes(megabytes: int) -> dict[str, tuple[int, ...]]:
    """Weight shapes of a GPT-2 (hidden 512, vocabulary 8192) with as many layers as make the
    weights and two Adam moments about ``megabytes`` MiB."""
    hidden, vocab = 512, 8192
    layer = {
        "attn/c_attn/weight": (hidden, 3 * hidden),
        "attn/c_attn/bias": (3 * hidden,),
        "attn/c_proj/weight": (hidden, hidden),
        "mlp/c_fc/weight": (hidden, 4 * hidden),
        "mlp/c_fc/bias": (4 * hidden,),
        "mlp/c_proj/weight": (4 * hidden, hidden),
        "ln_1/weight": (hidden,),
        "ln_2/weight": (hidden,),
    }
    per_layer = sum(_count(s) for s in layer.values()) * 4 * 3
    fixed = (vocab * hidden + 1024 * hidden) * 4 * 3
    layers = max(1, round(((megabytes << 20) - fixed) / per_layer))
    shapes = {"wte": (vocab, hidden), "wpe": (1024, hidden)}
    for i in range(layers):
        shapes.update({f"blocks/{i}/{name}": shape for name, shape in layer.items()})
    return shapes


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def worker(megabytes: int, directory: str) -> None:
    """Build the state, say so, then time one save (stdin line ``save``) or one restore (``restore``)
    with the levanter_core this process imports for each line read, printing each time as a JSON
    line."""
    import jax
    import numpy as np

    from levanter_core.checkpoint import load_checkpoint, write_checkpoint

    rng = np.random.default_rng(0)
    weights = {
        name: rng.standard_normal(shape, dtype=np.float32) for name, shape in gpt2_like_shapes(megabytes).items()
    }
    state = {
        "step": jax.numpy.asarray(1000, jax.numpy.int32),
        "model": {name: jax.device_put(w) for name, w in weights.items()},
        "opt_state": {
            "mu": {name: jax.device_put(w * 0.1) for name, w in weights.items()},
            "nu": {name: jax.device_put(w * w) for name, w in weights.items()},
        },
    }
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    path = os.path.join(directory, str(os.getpid()), "step-0")  # a step-N directory holds step N
    loaded = load_checkpoint(template, write_checkpoint(state, path, step=0))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state))), "restore differs"
    import levanter_core

    code = os.path.dirname(levanter_core.__file__)
    print(
        json.dumps({"code": code, "state_mib": nbytes / (1 << 20), "arrays": len(jax.tree.leaves(state))}), flush=True
    )
    for line in sys.stdin:
        if line.strip() == "save":
            shutil.rmtree(path)
            start = time.perf_counter()
            write_checkpoint(state, path, step=0)
        else:  # a checkpoint this process has not read: TensorStore keeps no chunk of it in memory
            shutil.rmtree(path)
            write_checkpoint(state, path, step=0)
            start = time.perf_counter()
            jax.block_until_ready(load_checkpoint(template, path))
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


def baseline_tree(revision: str, into: str) -> str:
    """A copy of ``levanter_core`` as of ``revision``, under ``into``; returns the directory
    to put first on ``PYTHONPATH``."""
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", revision, "levanter_core"], check=True, capture_output=True
    ).stdout
    os.makedirs(into, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def hash_seconds(megabytes: int) -> float:
    """The least of 5 timings of XXH3-64 over every array of the benchmark's state."""
    import numpy as np
    import xxhash

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape, dtype=np.float32) for shape in gpt2_like_shapes(megabytes).values()] * 3
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for array in arrays:
            xxhash.xxh3_64_hexdigest(array.reshape(-1).view(np.uint8))
        times.append(time.perf_counter() - start)
    return min(times)


def start_worker(code: str, megabytes: int, directory: str) -> tuple[subprocess.Popen, dict]:
    """A worker process running the levanter_core under ``code``, and what it says of its state."""
    env = {**os.environ, "PYTHONPATH": code, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--megabytes", str(megabytes),
               "--directory", directory]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return process, _last_json(process)


def _last_json(process: subprocess.Popen) -> dict:
    """The next JSON line the worker prints (skipping anything else it prints)."""
    for line in process.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"the worker ended (exit {process.wait()})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=128, help="size of the training state (MiB)")
    parser.add_argument("--repeats", type=int, default=30, help="turns of saves, then of restores, by each version")
    parser.add_argument("--baseline", default="c7ef36c", help="the commit to compare with (before checksums)")
    parser.add_argument("--directory", help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", help="JSON results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        worker(args.megabytes, args.directory)
        return

    with tempfile.TemporaryDirectory(prefix="bench-checksum-") as scratch:
        directory = args.directory or os.path.join(scratch, "checkpoints")
        os.makedirs(directory, exist_ok=True)
        versions = {"baseline": baseline_tree(args.baseline, os.path.join(scratch, "baseline")), "checksums": REPO}
        timings: dict[str, dict[str, list[float]]] = {name: {"save": [], "restore": []} for name in versions}
        workers = {}
        for name, code in versions.items():
            workers[name], described = start_worker(code, args.megabytes, directory)
            assert described.pop("code").startswith(code), f"{name} does not run the code under {code}"
        try:
            for kind in ("save", "restore"):
                for turn in range(args.repeats):
                    for name in list(versions) if turn % 2 == 0 else list(reversed(versions)):
                        workers[name].stdin.write(f"{kind}\n")
                        workers[name].stdin.flush()
                        timings[name][kind].append(_last_json(workers[name])["seconds"])
        finally:
            for process in workers.values():
                process.stdin.close()
                process.wait()

    hashing = hash_seconds(args.megabytes)
    medians = {name: {kind: statistics.median(t) for kind, t in kinds.items()} for name, kinds in timings.items()}
    minimums = {name: {kind: min(t) for kind, t in kinds.items()} for name, kinds in timings.items()}
    print(f"state: {described['arrays']} arrays, {described['state_mib']:.0f} MiB; {args.repeats} turns; "
          f"baseline {args.baseline}; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    for kind in ("save", "restore"):
        for figure, values in (("median", medians), ("minimum", minimums)):
            before, after = values["baseline"][kind], values["checksums"][kind]
            print(
                f"  {kind:<8} {figure:<8} baseline {before:6.3f} s   checksums {after:6.3f} s   "
                f"{100 * (after / before - 1):+5.1f}%"
            )
    print(
        f"  XXH3-64 of the whole state alone: {hashing * 1000:.1f} ms, {100 * hashing / medians['baseline']['save']:.1f}% "
        f"of the baseline's median save, {100 * hashing / medians['baseline']['restore']:.1f}% of its median restore"
    )
    if args.out:
        record = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0],
            "baseline": args.baseline,
            **described,
            "median_seconds": medians,
            "minimum_seconds": minimums,
            "hash_seconds": hashing,
            "seconds": timings,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
