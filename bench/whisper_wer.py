"""Word error rates of speech recognition trained here, on speech synthesized on the machine.

Two runs of ``levanter train`` on the corpus ``make speech-data`` writes (2,000 sentences in four
eSpeak NG voices for training, 64 other sentences held out), each logging ``eval/wer`` (greedy
transcripts of the held-out sentences against their text) before the first step and at every
evaluation:

* **scratch**: ``config/whisper_nano.yaml`` as it is, a small Whisper trained from random weights;
* **finetune**: a tiny Hugging Face ``WhisperForConditionalGeneration`` written by
  ``transformers`` (the nano shapes, random weights: real checkpoints cannot be downloaded
  here) with a byte-level ``tokenizer.json``, imported with ``initialize_from_hf`` and
  fine-tuned with the same config: the word error rate before (the imported model's, at step 0)
  and after.

Run: ``python bench/whisper_wer.py [--steps 2000] [--finetune-steps 1000] [--workdir DIR] [--out FILE]``.
It prints a table and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "config", "whisper_nano.yaml")
VOICES = ["en-us+Storm", "en-us+shelby", "en-us+Denis", "en-us+michel"]


def speech_data(directory: str) -> tuple[str, str]:
    """The manifests of ``make speech-data``'s corpus, written under ``directory`` if missing."""
    from levanter_audio.sentences import random_sentences
    from levanter_audio.synth import make_speech_corpus

    manifests = []
    for split, count, seed in (("train", 2000, 0), ("validation", 64, 1)):
        manifest = os.path.join(directory, split, "manifest.jsonl")
        if not os.path.exists(manifest):
            make_speech_corpus(os.path.join(directory, split), random_sentences(count, seed), fmt="flac", voice=VOICES)
        manifests.append(manifest)
    return manifests[0], manifests[1]


def tiny_hf_whisper(directory: str) -> str:
    """A random Hugging Face Whisper of ``config/whisper_nano.yaml``'s shapes with the byte-level
    tokenizer (257 tokens, ``<|endoftext|>`` last), saved as a model directory."""
    import torch
    import transformers
    import yaml

    from levanter_core.data.tokenizer import ByteTokenizer

    with open(CONFIG) as f:
        model = yaml.safe_load(f)["model"]
    os.makedirs(directory, exist_ok=True)
    tokenizer = ByteTokenizer()
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        f.write(tokenizer.to_tokenizer_json())
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    eos = tokenizer.eos_id
    config = transformers.WhisperConfig(
        vocab_size=tokenizer.vocab_size,
        num_mel_bins=model["num_mel_bins"],
        d_model=model["d_model"],
        encoder_layers=model["encoder_layers"],
        decoder_layers=model["decoder_layers"],
        encoder_attention_heads=model["encoder_attention_heads"],
        decoder_attention_heads=model["decoder_attention_heads"],
        encoder_ffn_dim=model["encoder_ffn_dim"],
        decoder_ffn_dim=model["decoder_ffn_dim"],
        max_source_positions=model["max_source_positions"],
        max_target_positions=model["seq_len"],
        pad_token_id=eos,
        bos_token_id=eos,
        eos_token_id=eos,
        decoder_start_token_id=eos,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    torch.manual_seed(0)
    transformers.WhisperForConditionalGeneration(config).save_pretrained(directory)
    return directory


def train(workdir: str, run_id: str, manifests: tuple[str, str], steps: int, *extra: str) -> dict:
    """``levanter train config/whisper_nano.yaml`` into ``workdir`` for ``steps`` steps; the
    evaluations it logged and its wall time."""
    train_manifest, validation_manifest = manifests
    args = [
        sys.executable, "-c", "from levanter_core.cli import main; main()", "train", CONFIG, "--no-progress",
        "--data.train_urls", json.dumps([train_manifest]),
        "--data.validation_urls", json.dumps([validation_manifest]),
        "--data.cache_dir", os.path.join(workdir, "cache", run_id),
        "--trainer.id", run_id,
        "--trainer.log_dir", os.path.join(workdir, "logs"),
        "--trainer.checkpointer.base_path", os.path.join(workdir, "checkpoints"),
        "--trainer.num_train_steps", str(steps),
        "--trainer.steps_per_eval", str(max(steps // 4, 1)),
        "--trainer.require_accelerator", "false",
        *extra,
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(args, check=True, cwd=workdir)
    seconds = time.perf_counter() - started
    evals = []
    with open(os.path.join(workdir, "logs", run_id, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if "eval/wer" in record:
                evals.append({"step": record["step"], "loss": record["eval/loss"], "wer": record["eval/wer"]})
    return {"steps": steps, "seconds": round(seconds, 1), "evals": evals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps from scratch")
    parser.add_argument("--finetune-steps", type=int, default=1000, help="fine-tuning steps of the imported model")
    parser.add_argument("--workdir", default="bench-whisper-wer", help="data, caches, logs and checkpoints go here")
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)

    import jax

    manifests = speech_data(os.path.join(workdir, "speech"))
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()}: {jax.devices()[0].device_kind} ({jax.default_backend()}), {os.cpu_count()} cores",
        "scratch": train(workdir, "scratch", manifests, args.steps),
    }
    if args.finetune_steps:
        hf = tiny_hf_whisper(os.path.join(workdir, "tiny-hf-whisper"))
        results["finetune"] = train(
            workdir, "finetune", manifests, args.finetune_steps,
            "--initialize_from_hf", hf, "--use_hf_model_config", "true", "--data.tokenizer", hf,
        )  # fmt: skip
    print(f"\n{results['machine']}, {results['date']}")
    print(f"{'run':<10} {'steps':>6} {'seconds':>8}  eval/wer by step (eval/loss)")
    for name in ("scratch", "finetune"):
        if name in results:
            run = results[name]
            evals = ", ".join(f"{e['step']}: {e['wer']:.3f} ({e['loss']:.3f})" for e in run["evals"])
            print(f"{name:<10} {run['steps']:>6} {run['seconds']:>8}  {evals}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
