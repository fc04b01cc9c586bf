"""Generation speed: our engine beside ``transformers``' ``generate`` (torch, CPU) on the same
model and prompts, in the same run.

The model is a random Llama-architecture decoder (hidden 256, 4 layers, 4 heads, 8,192-token
vocabulary; about the size of the reference GPT-2), made by ``transformers`` and loaded by both
sides from the same directory. Both decode greedily, the end-of-sequence token ignored, in
float32. Each figure is the median of ``--repeats`` timed runs after a warm-up run that
compiles (ours) or warms the allocator (theirs).

* decode tokens/s at batch 1 and at batch 16: new tokens per second after the first one
  (``(new - 1) / (total - time to first token)``), prompts of 32 tokens, 128 new tokens;
* prefill tokens/s: prompt tokens per second to the first generated token (8 prompts of 256);
* time to first token: one 32-token prompt alone;
* the server: ``levanter serve`` on the same model (its own process, 32 sequences decoded
  together) answering ``--server-requests`` completions (prompts of 16 to 64 tokens, 64 new
  tokens each) from 32 concurrent clients over loopback HTTP: requests/s and p50/p99 latency.
  ``transformers``' side gets the same requests as static batches of 32 through ``generate``
  (left-padded, no HTTP): each request's latency is its batch's time, the best a server that
  batches with ``generate`` could do.

Run: ``python bench/generate.py [--repeats 3] [--server-requests 128] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

import numpy as np


def make_model(directory: str):
    import transformers

    from levanter_core.hf.parity import random_hf_model
    from levanter_core.testing import train_bpe_tokenizer

    # the server needs a tokenizer: byte-level BPE trained on this Python's standard library
    stdlib = sysconfig.get_paths()["stdlib"]
    sources = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py"))
    texts = [open(f, encoding="utf-8", errors="replace").read() for f in sources]
    train_bpe_tokenizer(texts, os.path.join(directory, "tokenizer.json"), vocab_size=8192)

    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    random_hf_model(config, seed=0, noise=0.02).save_pretrained(directory)


def theirs(directory: str, prompts: np.ndarray, new_tokens: int) -> tuple[float, float]:
    """(total seconds, seconds to the first token) of ``transformers``' batched greedy generate."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.as_tensor(prompts)
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)

    def run(n):
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        return time.perf_counter() - started

    run(2)  # warm-up
    return run(new_tokens), run(1)


def ours(directory: str, prompts: np.ndarray, new_tokens: int) -> tuple[float, float]:
    """(total seconds, seconds to the first token) of our engine on the same prompts, all submitted at once."""
    from levanter_core.inference.engine import Engine
    from levanter_core.inference.sampling import SamplingParams
    from levanter_core.models.source import load_model_source

    loaded = load_model_source(directory)
    rows = [p.tolist() for p in prompts]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with Engine(loaded.model, max_seqs=len(rows), max_rounds=8, max_prefill_seqs=len(rows)) as engine:
        engine.generate(rows, params)  # compiles
        started = time.perf_counter()
        done = engine.generate(rows, params)
        total = time.perf_counter() - started
    return total, max(c[0].time_to_first_token for c in done)


def server_workload(requests: int, seed: int = 1) -> list[tuple[list[int], int]]:
    """``(prompt, new tokens)`` of each request: prompts of 16 to 64 random tokens, 64 new tokens."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, 8192, size=int(rng.integers(16, 65))).tolist(), 64) for _ in range(requests)]


def ours_server(directory: str, workload, clients: int, repeats: int) -> dict:
    """``levanter serve`` in a subprocess; ``clients`` threads each send their share of the
    workload one request after another. The first pass warms up (compiles every bucket)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    levanter = os.path.join(os.path.dirname(sys.executable), "levanter")
    server = subprocess.Popen(
        [levanter, "serve", directory, "--port", str(port), "--max-seqs", str(clients), "--max-rounds", "8", "--precompile"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {server.stderr.read()}")
            time.sleep(0.2)

        def one_pass() -> tuple[float, list[float]]:
            latencies, lock = [], threading.Lock()

            def client(mine):
                with httpx.Client(base_url=url, timeout=600) as http:
                    for prompt, new in mine:
                        body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
                        started = time.perf_counter()
                        answer = http.post("/v1/completions", json=body)
                        took = time.perf_counter() - started
                        answer.raise_for_status()
                        assert answer.json()["usage"]["completion_tokens"] == new
                        with lock:
                            latencies.append(took)

            threads = [threading.Thread(target=client, args=(workload[i::clients],)) for i in range(clients)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return time.perf_counter() - started, latencies

        one_pass()  # warm-up
        runs = [one_pass() for _ in range(repeats)]
    finally:
        server.terminate()
        server.wait(60)
    return _server_figures(runs, len(workload))


def theirs_server(directory: str, workload, clients: int, repeats: int) -> dict:
    """The same requests as static batches of ``clients`` through ``transformers``' generate."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def batch(rows):
        width = max(len(p) for p, _ in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (prompt, _) in enumerate(rows):  # left padding, as decoder-only generation needs
            ids[i, width - len(prompt) :] = torch.as_tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        new = max(n for _, n in rows)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip

    def one_pass() -> tuple[float, list[float]]:
        latencies = []
        started = time.perf_counter()
        for i in range(0, len(workload), clients):
            rows = workload[i : i + clients]
            batch_started = time.perf_counter()
            batch(rows)
            latencies += [time.perf_counter() - batch_started] * len(rows)
        return time.perf_counter() - started, latencies

    batch(workload[:2])  # warm-up
    return _server_figures([one_pass() for _ in range(repeats)], len(workload))


def _server_figures(runs, requests: int) -> dict:
    total = statistics.median(r[0] for r in runs)
    latencies = sorted(x for _, lat in runs for x in lat)

    def pct(q):
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))]

    return {"total_s": total, "requests_per_s": requests / total, "p50_s": pct(0.50), "p99_s": pct(0.99)}


def measure(fn, directory, prompts, new_tokens, repeats) -> dict:
    runs = [fn(directory, prompts, new_tokens) for _ in range(repeats)]
    total = statistics.median(r[0] for r in runs)
    first = statistics.median(r[1] for r in runs)
    batch = len(prompts)
    return {
        "total_s": total,
        "first_token_s": first,
        "decode_tokens_per_s": batch * (new_tokens - 1) / max(total - first, 1e-9),
        "prefill_tokens_per_s": prompts.size / first,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--server-requests", type=int, default=128, help="0: skip the server benchmark")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    results = {
        "machine": f"{os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "torch_threads": torch.get_num_threads(),
    }
    with tempfile.TemporaryDirectory() as directory:
        make_model(directory)
        cases = {
            "batch 1": (rng.integers(1, 8192, size=(1, 32)), args.new_tokens),
            "batch 16": (rng.integers(1, 8192, size=(16, 32)), args.new_tokens),
            "prefill 8x256": (rng.integers(1, 8192, size=(8, 256)), 2),
        }
        for name, (prompts, new_tokens) in cases.items():
            for side, fn in (("transformers", theirs), ("levanter", ours)):
                results[f"{name} / {side}"] = r = measure(fn, directory, prompts, new_tokens, args.repeats)
                print(f"{name:>14} {side:>12}: decode {r['decode_tokens_per_s']:8.1f} tok/s, "
                      f"prefill {r['prefill_tokens_per_s']:8.1f} tok/s, first token {r['first_token_s'] * 1000:7.1f} ms, "
                      f"total {r['total_s']:.2f} s", flush=True)  # fmt: skip
        if args.server_requests:
            workload = server_workload(args.server_requests)
            for side, fn in (("transformers", theirs_server), ("levanter", ours_server)):
                results[f"server / {side}"] = r = fn(directory, workload, args.clients, args.repeats)
                print(f"{'server':>14} {side:>12}: {r['requests_per_s']:.2f} requests/s, p50 {r['p50_s']:.2f} s, "
                      f"p99 {r['p99_s']:.2f} s, total {r['total_s']:.1f} s ({args.clients} clients)", flush=True)  # fmt: skip
    for name in ("batch 1", "batch 16"):
        ratio = (
            results[f"{name} / levanter"]["decode_tokens_per_s"]
            / results[f"{name} / transformers"]["decode_tokens_per_s"]
        )
        print(f"decode at {name}: {ratio:.2f}x transformers")
    ratio = (
        results["prefill 8x256 / levanter"]["prefill_tokens_per_s"]
        / results["prefill 8x256 / transformers"]["prefill_tokens_per_s"]
    )
    print(f"prefill: {ratio:.2f}x transformers")
    if args.server_requests:
        ratio = results["server / levanter"]["requests_per_s"] / results["server / transformers"]["requests_per_s"]
        print(f"server requests/s: {ratio:.2f}x transformers' static batches")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
