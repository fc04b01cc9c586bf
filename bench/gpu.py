"""The accelerator figures (issue 39), in one command that fits a short lease of one GPU.

    python bench/gpu.py --out DIR [--budget 450]        # on one H100 / H200 (bench/gpu.sh sets it up)
    python bench/gpu.py --quick --out DIR               # the same logic on CPU, tiny models, in seconds

Parts, run one after the other, each in a process of its own (so each starts with the device's
memory free, and one part's failure leaves the others' figures):

1. ``train-llama1b``: training throughput and MFU of a 0.99 B Llama (Llama-3.2-1B's shapes with
   an 8,192-token vocabulary) at sequence 2048 in bf16 compute, through ``reference_gpt2.py``
   (the real ``run_training`` path: tokenizer, cache, trainer, evaluation, final checkpoint).
2. ``decode-llama1b``: our inference engine on the same model (random weights in bf16): decode
   tokens/s at batch 1 and 64, prefill tokens/s and time to first token; ``transformers``'
   ``generate`` on the same shapes beside it when torch is installed.
3. ``train-llama350m``: the 344 M preset, as 1.
4. ``train-llama1b-keep``: the 1 B model keeping every activation (no recomputation).
5. ``whisper``: ``whisper_train.py``'s step beside ``transformers``' (whisper-tiny, bf16).

A part is started only if the time it usually takes still fits in ``--budget`` seconds, and is
stopped if it runs past what is left; skipped and failed parts say so in the summary. MFU is
given two ways: against the bf16 matmul rate measured in the same process (8192^3, what the
device really reaches), and against the device's published dense bf16 peak, as torchtitan and
MaxText report it. Model FLOPs count the full attention map (Megatron-LM's and Levanter's count).

Writes, into ``--out``: ``summary.json`` (every figure), ``summary.md`` (a table for
``bench/RESULTS.md``) and ``gpu.log`` (every part's output), rewritten after each part.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

PEAK_BF16_TFLOPS = {"H200": 989.4, "GH200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "B200": 2250.0}
"""Published dense bf16 peaks, by a piece of the device's name (first match wins: list the longer
names first). H100 means the SXM part."""


def published_peak(device_kind: str) -> float | None:
    """The published dense bf16 TFLOP/s of the device named ``device_kind``, if known."""
    for name, tflops in PEAK_BF16_TFLOPS.items():
        if name.lower() in device_kind.lower():
            return tflops
    return None


# -- the parts ---------------------------------------------------------------------------------


def parts(quick: bool, out_dir: str, work: str) -> list[dict]:
    """What to run: each part's name, command, expected seconds and what its JSON holds."""
    py = sys.executable
    ref = os.path.join(HERE, "reference_gpt2.py")

    def train(preset, steps, expect, extra=(), profile=None):
        # profile: (first step index, steps) traced; the trace goes to out_dir and is summed there
        trace = os.path.join(out_dir, f"{preset}-trace.json.gz") if profile else None
        if profile:
            extra = (*extra, "--profile", f"{profile[0]}:{profile[1]}", "--profile-out", trace)
        return {
            "name": f"train-{preset}", "kind": "train", "expect_s": expect, "trace": trace,
            "profiled_steps": profile[1] if profile else None,
            "argv": [py, ref, "--model", preset, "--steps", str(steps), "--workdir", os.path.join(work, preset),
                     "--out", os.path.join(work, f"train-{preset}.json"), *extra],
            "json": os.path.join(work, f"train-{preset}.json"),
        }  # fmt: skip

    def decode(preset, expect, extra=()):
        return {
            "name": f"decode-{preset}", "kind": "decode", "expect_s": expect,
            "argv": [py, os.path.abspath(__file__), "decode", "--preset", preset,
                     "--out", os.path.join(work, f"decode-{preset}.json"), *extra],
            "json": os.path.join(work, f"decode-{preset}.json"),
        }  # fmt: skip

    if quick:
        return [
            train("tiny", 7, 60, ("--max-files", "20"), profile=(3, 1)),
            decode("llama", 60, ("--quick", "--repeats", "1")),
        ]
    whisper_json = os.path.join(work, "whisper.json")
    return [
        train("llama1b", 30, 150, profile=(20, 2)),
        decode("llama1b", 100),
        train("llama350m", 30, 90),
        train("llama1b-keep", 30, 120),
        {
            "name": "whisper", "kind": "whisper", "expect_s": 70, "json": whisper_json,
            "argv": [py, os.path.join(HERE, "whisper_train.py"), "--preset", "tiny", "--device", "gpu", "--batch", "64",
                     "--rounds", "2", "--steps", "5", "--warmup", "2", "--mp", "p=f32,c=bfloat16", "--out", whisper_json],
        },
    ]  # fmt: skip


def run_parts(todo: list[dict], budget: float, out_dir: str) -> dict:
    """Run ``todo`` within ``budget`` seconds, writing the summary after each part."""
    started = time.monotonic()
    summary = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "budget_s": budget,
        "parts": {},
    }
    log_path = os.path.join(out_dir, "gpu.log")
    for part in todo:
        left = budget - (time.monotonic() - started)
        record = {"expect_s": part["expect_s"]}
        summary["parts"][part["name"]] = record
        if left < part["expect_s"]:
            record["status"] = f"skipped: {left:.0f} s of the budget left, it takes about {part['expect_s']} s"
            print(f"[gpu] {part['name']}: {record['status']}", flush=True)
            write_summary(summary, out_dir)
            continue
        print(f"[gpu] {part['name']}: starting ({left:.0f} s of the budget left)", flush=True)
        part_started = time.monotonic()
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"\n===== {part['name']}: {' '.join(part['argv'])}\n")
            log.flush()
            try:
                # a part may run past its estimate, but never past the budget (plus a little, so
                # that a part nearly done can finish)
                code = subprocess.run(
                    part["argv"], stdout=log, stderr=subprocess.STDOUT, timeout=left + 30, env=part_environment()
                ).returncode
            except subprocess.TimeoutExpired:
                code = None
        record["seconds"] = round(time.monotonic() - part_started, 1)
        if code == 0 and os.path.exists(part["json"]):
            with open(part["json"], encoding="utf-8") as f:
                record["status"] = "ok"
                record["figures"] = condense(part["kind"], json.load(f))
            if part.get("trace"):
                record["profile"] = profile_summary(part["trace"], part["profiled_steps"])
        else:
            record["status"] = "timed out" if code is None else f"failed (exit {code}); see gpu.log"
        print(f"[gpu] {part['name']}: {record['status']} in {record['seconds']} s", flush=True)
        write_summary(summary, out_dir)
    return summary


def profile_summary(trace: str, steps: int) -> dict:
    """Where a part's profiled steps spent the device's time (``trace_summary.py``), or why not."""
    sys.path.insert(0, HERE)
    import trace_summary

    try:
        summary = trace_summary.summarize(trace_summary.load(trace), steps, top=30)
    except (OSError, ValueError, KeyError, SystemExit) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {**summary, "markdown": trace_summary.markdown(summary)}


def part_environment() -> dict:
    """A part's environment: unbuffered output (the log shows how far a part got), and most of the
    device's memory for JAX (its default, 75%, is short of what the 1 B model keeping every
    activation needs on an 80 GB card)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    return env


def condense(kind: str, result: dict) -> dict:
    """The figures of one part's JSON that the summary keeps."""
    if kind == "train":
        machine = result["machine"]
        device = machine.get("device_kind", "")
        peak = published_peak(device)
        model_tflops = result["model_gflops_per_second"] / 1000
        return {
            "device": device,
            "jax": machine["jax"],
            "parameters": result["model"]["parameters"],
            "model": result["model"]["model"],
            "trainer": result["model"]["trainer"],
            "tokens_per_step": result["tokens_per_step"],
            "tokens_per_second": result["tokens_per_second"]["median"],
            "step_seconds": result["step_seconds"]["median"],
            "steady_state_steps": result["steady_state_steps"],
            "model_tflops": model_tflops,
            "matmul_tflops": result["matmul_gflops"]["mean"]["median"] / 1000,
            "mfu_measured_matmul": result["mfu"],
            "published_peak_tflops": peak,
            "mfu_published_peak": model_tflops / peak if peak else None,
            "loss": result["loss"],
            "device_peak_memory_gib": result.get("device_peak_memory_gib"),
            "run_training_to_first_step_logged_s": result["seconds"]["run_training_to_first_step_logged"],
            "wall_s": result["seconds"]["wall"],
        }
    if kind == "whisper":
        ours, theirs = result["ours"], result["transformers"]
        return {
            "machine": result["machine"], "batch": result["batch"], "mp": result["mp"],
            "ours_step_seconds": ours["step_seconds"]["median"], "transformers_step_seconds": theirs["step_seconds"]["median"],
            "ours_audio_seconds_per_second": ours["audio_seconds_per_second"],
            "transformers_audio_seconds_per_second": theirs["audio_seconds_per_second"],
            "ratio": result["ratio"],
        }  # fmt: skip
    return result


def write_summary(summary: dict, out_dir: str) -> None:
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write(markdown(summary))


def markdown(summary: dict) -> str:
    """The summary as tables for ``bench/RESULTS.md``."""
    lines = [f"bench/gpu.py, {summary['date']}", ""]
    train = {n: p for n, p in summary["parts"].items() if p.get("status") == "ok" and n.startswith("train-")}
    if train:
        lines += [
            "| model | parameters | device | tokens/step | tokens/s | step | model TFLOP/s | MFU (measured matmul) | MFU (published peak) | loss first -> last |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, part in train.items():
            r = part["figures"]
            peak = (
                f"{r['mfu_published_peak']:.1%} of {r['published_peak_tflops']:.0f}"
                if r["mfu_published_peak"]
                else "n/a"
            )
            lines.append(
                f"| {name[len('train-') :]} | {r['parameters'] / 1e6:,.0f} M | {r['device']} | {r['tokens_per_step']:,} | "
                f"{r['tokens_per_second']:,.0f} | {r['step_seconds']:.3f} s | {r['model_tflops']:.1f} | "
                f"{r['mfu_measured_matmul']:.1%} of {r['matmul_tflops']:.0f} | {peak} | "
                f"{r['loss']['first_step']:.3f} -> {r['loss']['last_step']:.3f} |"
            )
        lines.append("")
    for name, part in summary["parts"].items():
        if part.get("status") == "ok" and name.startswith("decode-"):
            r = part["figures"]
            lines += [f"{name}: {r['parameters'] / 1e6:,.0f} M parameters, {r['dtype']}, {r['device']}", "",
                      "| case | side | decode tokens/s | prefill tokens/s | first token | total |", "|---|---|---|---|---|---|"]  # fmt: skip
            for case, sides in r["cases"].items():
                for side, c in sides.items():
                    lines.append(
                        f"| {case} | {side} | {c['decode_tokens_per_s']:,.1f} | {c['prefill_tokens_per_s']:,.0f} | "
                        f"{c['first_token_s'] * 1000:.1f} ms | {c['total_s']:.3f} s |"
                    )
            lines.append("")
    for name, part in summary["parts"].items():
        if "markdown" in part.get("profile", {}):
            lines += [f"{name}, profiled:", "", part["profile"]["markdown"]]
    for name, part in summary["parts"].items():
        if part.get("status") != "ok" or name == "whisper":
            lines.append(f"- {name}: {part.get('status')}" + (f" ({part['seconds']} s)" if "seconds" in part else ""))
    if summary["parts"].get("whisper", {}).get("status") == "ok":
        lines.append(f"- whisper: see summary.json ({summary['parts']['whisper']['seconds']} s)")
    return "\n".join(lines) + "\n"


# -- decoding ----------------------------------------------------------------------------------


def decode_cases(quick: bool) -> dict[str, tuple[int, int, int]]:
    """``name -> (prompts, prompt tokens, new tokens)``."""
    if quick:
        return {"batch 1": (1, 16, 16), "batch 4": (4, 16, 16), "prefill 4x64": (4, 64, 2)}
    return {"batch 1": (1, 128, 128), "batch 64": (64, 128, 128), "prefill 16x1024": (16, 1024, 2)}


def timed(fn, repeats: int) -> dict:
    """Median of ``repeats`` runs of ``fn() -> (total seconds, seconds to the first token)``, after one
    untimed run (compilation, allocator warm-up)."""
    fn()
    runs = [fn() for _ in range(repeats)]
    return {"total_s": statistics.median(r[0] for r in runs), "first_token_s": statistics.median(r[1] for r in runs)}


def rates(figures: dict, rows: int, prompt: int, new: int) -> dict:
    total, first = figures["total_s"], figures["first_token_s"]
    return {
        **figures,
        "decode_tokens_per_s": rows * (new - 1) / max(total - first, 1e-9),
        "prefill_tokens_per_s": rows * prompt / first,
    }


def decode_benchmark(preset: str, quick: bool, repeats: int) -> dict:
    """Our engine (and ``transformers``, if there) on the ``PRESETS[preset]`` model, random weights,
    bf16 on a GPU (float32 on CPU), greedy, end-of-sequence ignored."""
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, HERE)
    import reference_gpt2

    from levanter_core.inference.engine import Engine
    from levanter_core.inference.sampling import SamplingParams
    from levanter_core.plugins import registry

    fields = dict(reference_gpt2.PRESETS[preset]["model"])
    config = registry("model").get(fields["type"]).config_cls.model_validate(fields)
    vocab = reference_gpt2.VOCAB_SIZE
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    model = eqx.filter_jit(lambda key: config.build(hax.Axis("vocab", vocab), key=key))(jax.random.PRNGKey(0))
    model = jax.tree_util.tree_map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)
    parameters = sum(x.size for x in jax.tree_util.tree_leaves(model) if eqx.is_array(x))
    device = jax.devices()[0]
    result = {
        "preset": preset, "parameters": parameters, "dtype": jnp.dtype(dtype).name,
        "device": getattr(device, "device_kind", str(device)), "jax": jax.__version__, "cases": {},
    }  # fmt: skip
    rng = np.random.default_rng(0)
    cases = decode_cases(quick)
    for case, (rows, prompt, new) in cases.items():
        prompts = rng.integers(1, vocab, size=(rows, prompt))
        params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        listed = [p.tolist() for p in prompts]
        with Engine(
            model, max_seqs=rows, max_rounds=16, max_prefill_seqs=rows, max_seq_len=prompt + new + 16
        ) as engine:

            def ours(listed=listed, params=params, new=new):
                started = time.perf_counter()
                done = engine.generate(listed, params)
                total = time.perf_counter() - started
                assert all(len(c[0].tokens) == new for c in done)
                return total, max(c[0].time_to_first_token for c in done)

            result["cases"][case] = {"levanter": rates(timed(ours, repeats), rows, prompt, new)}
        print(f"{case}: levanter {result['cases'][case]['levanter']}", flush=True)
    del model
    try:
        import torch
        import transformers  # noqa: F401  (the peer: without it, only our figures)
    except ImportError:
        return result
    try:  # the peer's failure (a package missing on the machine) leaves our figures standing
        theirs = transformers_decoder(fields, vocab, gpu)
        for case, (rows, prompt, new) in cases.items():
            prompts = torch.as_tensor(rng.integers(1, vocab, size=(rows, prompt)), device=theirs.device)
            result["cases"][case]["transformers"] = rates(
                timed(lambda prompts=prompts, new=new: generate_theirs(theirs, prompts, new), repeats),
                rows,
                prompt,
                new,
            )
            print(f"{case}: transformers {result['cases'][case]['transformers']}", flush=True)
    except Exception as e:
        result["transformers_error"] = f"{type(e).__name__}: {e}"
        print(f"transformers failed: {result['transformers_error']}", flush=True)
    return result


def transformers_decoder(fields: dict, vocab: int, gpu: bool):
    """A random ``transformers`` Llama of the preset's shapes: bf16 on CUDA, float32 on CPU."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=fields["hidden_dim"], intermediate_size=fields["intermediate_dim"],
        num_hidden_layers=fields["num_layers"], num_attention_heads=fields["num_heads"],
        num_key_value_heads=fields["num_kv_heads"], max_position_embeddings=fields["seq_len"],
        tie_word_embeddings=fields.get("tie_word_embeddings", False),
    )  # fmt: skip
    device = "cuda" if gpu and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    return model.eval()


def generate_theirs(model, prompts, new: int) -> tuple[float, float]:
    """(total seconds, seconds to the first token) of ``generate``, greedy, all ``new`` tokens."""
    import torch

    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(prompts))

    def run(n):
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(prompts, max_new_tokens=n, min_new_tokens=n, **kwargs)
        if prompts.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    return run(new), run(1)


# -- the command -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("decode", help="only the decoding figures of one preset (a part of the whole)")
    one.add_argument("--preset", default="llama1b")
    one.add_argument("--repeats", type=int, default=3)
    one.add_argument("--quick", action="store_true")
    one.add_argument("--out", required=True)
    parser.add_argument("--out", default="bench/gpu-out", help="where summary.json, summary.md and gpu.log go")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all the parts (default 450)")
    parser.add_argument("--quick", action="store_true", help="tiny models on any machine: tests this script")
    parser.add_argument("--only", nargs="*", default=None, help="run only these parts, by name")
    args = parser.parse_args(argv)

    if args.command == "decode":
        # torch shares the device after JAX: JAX must not take 75% of its memory at start
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        result = decode_benchmark(args.preset, args.quick, args.repeats)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        return 0

    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="levanter-gpu-")
    todo = parts(args.quick, args.out, work)
    if args.only:
        unknown = set(args.only) - {p["name"] for p in todo}
        if unknown:
            parser.error(f"no part named {', '.join(sorted(unknown))}; the parts: {', '.join(p['name'] for p in todo)}")
        todo = [p for p in todo if p["name"] in args.only]
    summary = run_parts(todo, args.budget, args.out)
    print(markdown(summary))
    return 0 if any(p.get("status") == "ok" for p in summary["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
