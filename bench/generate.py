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
* time to first token: one 32-token prompt alone.

Run: ``python bench/generate.py [--repeats 3] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def make_model(directory: str):
    import transformers

    from levanter_core.hf.parity import random_hf_model

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
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    results = {"machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"), "torch_threads": torch.get_num_threads()}
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
    for name in ("batch 1", "batch 16"):
        ratio = results[f"{name} / levanter"]["decode_tokens_per_s"] / results[f"{name} / transformers"]["decode_tokens_per_s"]
        print(f"decode at {name}: {ratio:.2f}x transformers")
    ratio = results["prefill 8x256 / levanter"]["prefill_tokens_per_s"] / results["prefill 8x256 / transformers"]["prefill_tokens_per_s"]
    print(f"prefill: {ratio:.2f}x transformers")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
