"""lm-eval log-likelihood requests per second: our harness model (``levanter-eval-harness``)
beside lm-eval's own ``hf`` backend (transformers on torch), on the same model and requests, in
the same run.

The model is ``generate.py``'s random Llama (hidden 256, 4 layers, 8,192-token vocabulary,
context 512), made by ``transformers`` and loaded by both sides from the same directory, in
float32. The requests are lm-eval ``loglikelihood`` requests of two kinds, like the tasks
that make up most of a harness run:

* ``multi-token``: multiple choice with four answers of several tokens after a shared context
  (HellaSwag, ARC, PIQA...): ``--questions`` contexts of 40 to 400 tokens of Python source; we
  run each context once for its four answers (a key/value cache), lm-eval's ``hf`` backend
  four times;
* ``one-token``: four one-token answers (`` A`` ... `` D``) after a context (MMLU): the four
  requests of a question share their input, which both sides notice (lm-eval's
  ``logits_cache``, our shared contexts).

Both sides get the same batch size (``--batch-size``, distinct inputs per batch). Each figure
is the median of ``--repeats`` timed runs; ours is run once before (it compiles its batch
shapes: that run's time is reported as ``first run``), theirs on a few requests (warm-up).
The largest difference between the two sides' log-likelihoods is reported too: the same work.

Run: ``python bench/harness.py [--questions 64] [--batch-size 16] [--repeats 3] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def make_model_dir(directory: str) -> str:
    """``generate.py``'s model, with a ``tokenizer_config.json`` naming its end-of-text token
    (lm-eval's ``hf`` backend needs one)."""
    from generate import make_model

    make_model(directory)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}, f)
    return directory


def workloads(questions: int, seed: int = 0) -> dict[str, list[tuple[str, str]]]:
    """``(context, continuation)`` requests of each kind, cut from this Python's standard library."""
    stdlib = sysconfig.get_paths()["stdlib"]
    text = "".join(
        open(os.path.join(stdlib, f), encoding="utf-8", errors="replace").read()
        for f in sorted(os.listdir(stdlib))[:40]
        if f.endswith(".py")
    )
    rng = random.Random(seed)
    multi, single = [], []
    for _ in range(questions):
        start = rng.randrange(0, len(text) - 3000)
        context = text[start : start + rng.randint(150, 1500)]  # about 40 to 400 tokens
        for _ in range(4):
            at = rng.randrange(0, len(text) - 100)
            multi.append((context, text[at : at + rng.randint(10, 60)]))
        single += [(context + "\nAnswer:", f" {letter}") for letter in "ABCD"]
    return {"multi-token": multi, "one-token": single}


def instances(pairs):
    from lm_eval.api.instance import Instance

    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def timed(fn, requests) -> tuple[float, list]:
    started = time.perf_counter()
    answers = fn(requests)
    return time.perf_counter() - started, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from levanter_eval_harness.lm import LevanterLM
    from lm_eval.models.huggingface import HFLM

    from levanter_core.models.source import load_model_source

    figures: dict = {"questions": args.questions, "batch_size": args.batch_size, "workloads": {}}
    with tempfile.TemporaryDirectory() as directory:
        make_model_dir(directory)
        loaded = load_model_source(directory)
        ours = LevanterLM(loaded.model, loaded.tokenizer, eos_ids=loaded.eos_ids, batch_size=args.batch_size)
        theirs = HFLM(pretrained=directory, dtype="float32", device="cpu", batch_size=args.batch_size)
        for name, pairs in workloads(args.questions).items():
            requests = instances(pairs)
            first, our_answers = timed(lambda r: ours.loglikelihood(r, disable_tqdm=True), requests)
            our_runs = [
                timed(lambda r: ours.loglikelihood(r, disable_tqdm=True), requests)[0] for _ in range(args.repeats)
            ]
            theirs.loglikelihood(requests[:8], disable_tqdm=True)  # warm-up
            their_runs, their_answers = [], None
            for _ in range(args.repeats):
                seconds, their_answers = timed(lambda r: theirs.loglikelihood(r, disable_tqdm=True), requests)
                their_runs.append(seconds)
            ours_s, theirs_s = statistics.median(our_runs), statistics.median(their_runs)
            figures["workloads"][name] = {
                "requests": len(requests),
                "ours_requests_per_s": len(requests) / ours_s,
                "ours_first_run_requests_per_s": len(requests) / first,
                "theirs_requests_per_s": len(requests) / theirs_s,
                "speedup": theirs_s / ours_s,
                "max_abs_loglikelihood_difference": max(abs(a[0] - b[0]) for a, b in zip(our_answers, their_answers)),
                "greedy_flags_equal": all(a[1] == b[1] for a, b in zip(our_answers, their_answers)),
            }
        ours.close()

    print(
        f"{'workload':<12} {'requests':>8} {'ours req/s':>11} {'(1st run)':>10} {'hf req/s':>9} {'speedup':>8} {'max |dLL|':>10}"
    )
    for name, f in figures["workloads"].items():
        print(
            f"{name:<12} {f['requests']:>8} {f['ours_requests_per_s']:>11.1f} {f['ours_first_run_requests_per_s']:>10.1f} "
            f"{f['theirs_requests_per_s']:>9.1f} {f['speedup']:>7.2f}x {f['max_abs_loglikelihood_difference']:>10.2e}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
