"""Tokenization throughput of the cache build, with 1 and 2 worker processes.

The work of ``/work/shared/bench/REFERENCE.md``: every ``.py`` file of the running Python's
standard library (the ``python_stdlib`` source with no validation hold-out), one document
per file, tokenized with a byte-level BPE of 8,192 tokens trained on them with the
``tokenizers`` library. Each run builds the whole cache from scratch in a fresh directory
(worker start-up included) and the script prints a markdown table of wall time, tokens/s
and documents/s.

    python bench/tokenize_throughput.py [--workers 1 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from reference_gpt2 import train_tokenizer  # the same tokenizer as the training benchmark

from levanter_core.data.cache import open_cache
from levanter_core.data.source import PythonStdlibSourceConfig
from levanter_core.data.tokenizer import load_tokenizer


def measure(source, tokenizer, path: str, workers: int) -> dict:
    start = time.perf_counter()
    cache = open_cache(
        path, source, "train", tokenizer, enforce_eos=True, skip_bad_data=False, num_workers=workers, background=False
    )
    seconds = time.perf_counter() - start
    return {"workers": workers, "seconds": seconds, "documents": cache.num_documents, "tokens": cache.num_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--workdir", default=None, help="where the tokenizer and caches go (default: a temporary directory)"
    )
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="tokenize-bench-")
    source = PythonStdlibSourceConfig(validation_fraction=0)
    tokenizer_path = os.path.join(workdir, "tokenizer.json")
    if not os.path.exists(tokenizer_path):
        train_tokenizer(source, tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_path)
    results = [
        measure(source, tokenizer, os.path.join(workdir, f"cache-{w}-{time.time_ns()}"), w) for w in args.workers
    ]

    first = results[0]
    print(
        f"corpus: {first['documents']} files, {first['tokens']:,} tokens (BPE {tokenizer.vocab_size}); cpus: {os.cpu_count()}"
    )
    print("| workers | wall time (s) | tokens/s | docs/s |")
    print("|---|---|---|---|")
    for r in results:
        print(
            f"| {r['workers']} | {r['seconds']:.2f} | {r['tokens'] / r['seconds']:,.0f} | {r['documents'] / r['seconds']:,.0f} |"
        )


if __name__ == "__main__":
    main()
