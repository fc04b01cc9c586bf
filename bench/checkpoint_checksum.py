"""What checksumming every checkpoint array costs: save and restore times of the same training
state with the checkpointer of this working tree and with that of an earlier commit (before
checksums), measured in turns on the same machine.

    .venv/bin/python bench/checkpoint_checksum.py --baseline c7ef36c --out bench/last-checksum.json

The state looks like a small GPT-2's training state (weights and both Adam moments: three
copies of each matrix, float32 random normal values, which do not compress), ``--megabytes``
in all, in a local directory (``--directory``, default a temporary one, so that restores read
from the page cache and the figures are CPU time: compression, checksums, copies).

Each *round* starts one process per code version (baseline first, then this tree, alternating
which goes first each round), and each process times ``--repeats`` synchronous saves
(``write_checkpoint``: host copy, zstd, writing, metadata and marker) and as many restores
(``load_checkpoint`` into arrays on the device, until ready). The figure of a version is the
median over all its rounds, so that a busy machine's slow spells fall on both alike.
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


def worker(megabytes: int, repeats: int, directory: str) -> dict:
    """Time ``repeats`` saves and restores with the levanter_core this process imports."""
    import jax
    import numpy as np

    from levanter_core.checkpoint import load_checkpoint, write_checkpoint

    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in gpt2_like_shapes(megabytes).items()}
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
    saves, restores = [], []
    for i in range(repeats):
        path = os.path.join(directory, f"step-{i}")
        start = time.perf_counter()
        write_checkpoint(state, path, step=i)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        jax.block_until_ready(load_checkpoint(template, path))
        restores.append(time.perf_counter() - start)
        shutil.rmtree(path)
    loaded = load_checkpoint(template, write_checkpoint(state, os.path.join(directory, "step-check"), step=0))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state))), "restore differs"
    import levanter_core

    return {"code": os.path.dirname(levanter_core.__file__), "state_mib": nbytes / (1 << 20), "arrays": len(jax.tree.leaves(state)), "save": saves, "restore": restores}


def baseline_tree(revision: str, into: str) -> str:
    """A copy of ``levanter_core`` as of ``revision``, under ``into``; returns the directory
    to put first on ``PYTHONPATH``."""
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", revision, "levanter_core"], check=True, capture_output=True
    ).stdout
    os.makedirs(into, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def run_worker(code: str, args, directory: str) -> dict:
    env = {**os.environ, "PYTHONPATH": code, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--megabytes", str(args.megabytes),
               "--repeats", str(args.repeats), "--directory", directory]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=128, help="size of the training state (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="saves and restores per process")
    parser.add_argument("--rounds", type=int, default=4, help="processes per code version")
    parser.add_argument("--baseline", default="c7ef36c", help="the commit to compare with (before checksums)")
    parser.add_argument("--directory", help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", help="JSON results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args.megabytes, args.repeats, args.directory)))
        return

    with tempfile.TemporaryDirectory(prefix="bench-checksum-") as scratch:
        directory = args.directory or os.path.join(scratch, "checkpoints")
        os.makedirs(directory, exist_ok=True)
        versions = {"baseline": baseline_tree(args.baseline, os.path.join(scratch, "baseline")), "checksums": REPO}
        timings: dict[str, dict[str, list[float]]] = {name: {"save": [], "restore": []} for name in versions}
        described = {}
        for round_ in range(args.rounds):
            order = list(versions) if round_ % 2 == 0 else list(reversed(versions))
            for name in order:
                measured = run_worker(versions[name], args, directory)
                assert measured["code"].startswith(versions[name]), f"{name} ran {measured['code']}"
                described = {"state_mib": measured["state_mib"], "arrays": measured["arrays"]}
                for kind in ("save", "restore"):
                    timings[name][kind] += measured[kind]

    medians = {name: {kind: statistics.median(t) for kind, t in kinds.items()} for name, kinds in timings.items()}
    print(f"state: {described['arrays']} arrays, {described['state_mib']:.0f} MiB; "
          f"{args.rounds} processes x {args.repeats} per version; baseline {args.baseline}")  # fmt: skip
    for kind in ("save", "restore"):
        before, after = medians["baseline"][kind], medians["checksums"][kind]
        print(f"  {kind:<8} baseline {before:6.3f} s   checksums {after:6.3f} s   {100 * (after / before - 1):+5.1f}%")
    if args.out:
        record = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0],
            "baseline": args.baseline,
            **described,
            "median_seconds": medians,
            "seconds": timings,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
