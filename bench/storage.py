"""Checkpoints on an S3-compatible store: save and restore throughput beside the same server's
raw put and get throughput, measured in the same run.

The server is moto's (``levanter_core.testing.LocalS3Server``) on 127.0.0.1, in a process of
its own, holding objects in memory: it stands for the store, so the figures say how much of
what the store can take the checkpointer uses, not what a cloud bucket does.

    .venv/bin/python bench/storage.py --megabytes 256 --out bench/last-storage.json

The state is ``--arrays`` float32 arrays of random normal values (weights do not compress),
``--megabytes`` in all. Each measure is taken ``--repeats`` times and the best kept:

* **raw put / get**: the same bytes as objects of the array sizes, through boto3 (one client,
  the arrays' objects sent in parallel by a pool of ``--threads`` threads, and one at a time);
* **checkpoint save**: ``write_checkpoint`` into the bucket, from device arrays to the
  committed marker (host copy, zstd, TensorStore's parallel puts, metadata and marker);
* **checkpoint restore**: ``load_checkpoint`` of it into arrays on the device.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference_gpt2


def best_of(repeats: int, work) -> float:
    """The shortest of ``repeats`` timings of ``work()``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=256, help="size of the state (MiB)")
    parser.add_argument("--arrays", type=int, default=16, help="arrays it is made of")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=16, help="parallel requests of the raw puts and gets")
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args(argv)

    import boto3
    import jax
    import numpy as np

    from levanter_core.checkpoint import load_checkpoint, write_checkpoint
    from levanter_core.testing import LocalS3Server

    size = args.megabytes << 20
    per_array = size // args.arrays // 4
    rng = np.random.default_rng(0)
    host = {f"layer_{i:02d}": rng.standard_normal(per_array, dtype=np.float32) for i in range(args.arrays)}
    state = {name: jax.device_put(value) for name, value in host.items()}
    payloads = {name: value.tobytes() for name, value in host.items()}
    total = sum(len(p) for p in payloads.values())
    mib = total / (1 << 20)

    with LocalS3Server() as server:
        os.environ.update(server.environment)
        bucket = server.create_bucket("bench")
        env = server.environment
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"])
        pool = concurrent.futures.ThreadPoolExecutor(args.threads)

        def put(name: str) -> None:
            client.put_object(Bucket="bench", Key=f"raw/{name}", Body=payloads[name])

        def get(name: str) -> None:
            client.get_object(Bucket="bench", Key=f"raw/{name}")["Body"].read()

        results = {
            "raw_put_parallel": best_of(args.repeats, lambda: list(pool.map(put, payloads))),
            "raw_get_parallel": best_of(args.repeats, lambda: list(pool.map(get, payloads))),
            "raw_put_serial": best_of(args.repeats, lambda: [put(n) for n in payloads]),
            "raw_get_serial": best_of(args.repeats, lambda: [get(n) for n in payloads]),
        }
        saves = iter(range(args.repeats))
        results["checkpoint_save"] = best_of(
            args.repeats, lambda: write_checkpoint(state, f"{bucket}/ckpt/step-{next(saves)}", step=0)
        )
        template = {name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in state.items()}

        def restore() -> None:
            loaded = load_checkpoint(template, f"{bucket}/ckpt/step-0")
            jax.block_until_ready(loaded)

        results["checkpoint_restore"] = best_of(args.repeats, restore)
        loaded = load_checkpoint(template, f"{bucket}/ckpt/step-0")
        assert all(np.array_equal(np.asarray(loaded[n]), host[n]) for n in host), "restored state differs"
        pool.shutdown()

    rates = {name: mib / seconds for name, seconds in results.items()}
    print(f"state: {args.arrays} arrays, {mib:.0f} MiB; best of {args.repeats}; moto's S3 server on 127.0.0.1")
    for name, seconds in results.items():
        print(f"  {name:<22}{seconds:>8.2f} s {rates[name]:>8.1f} MiB/s")
    print(f"  save / raw parallel put: {rates['checkpoint_save'] / rates['raw_put_parallel']:.2f}; "
          f"restore / raw parallel get: {rates['checkpoint_restore'] / rates['raw_get_parallel']:.2f}")  # fmt: skip
    if args.out:
        record = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": reference_gpt2.machine(),
            "load_average_1min": os.getloadavg()[0],
            "state_mib": mib,
            "arrays": args.arrays,
            "seconds": results,
            "mib_per_second": rates,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
