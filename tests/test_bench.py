"""The benchmark suite (bench/suite.py): its presets and one whole run on a tiny model."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))

import reference_gpt2
import whisper_train


def parameters(model: str) -> int:
    from levanter_core.config.loader import Sources
    from levanter_core.config.train import validate_train_config

    raw = reference_gpt2.train_config("/nonexistent", "/nonexistent/tokenizer.json", 1, "count", model=model)
    return reference_gpt2.parameter_count(validate_train_config(raw, Sources("test")), reference_gpt2.VOCAB_SIZE)


def test_llama_preset_is_the_size_of_the_reference_gpt2():
    gpt2, llama = parameters("gpt2"), parameters("llama")
    assert abs(llama - gpt2) / gpt2 < 0.01, (gpt2, llama)
    assert 330e6 < parameters("llama350m") < 370e6
    assert 0.98e9 < parameters("llama1b") == parameters("llama1b-keep") < 1.0e9


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="unknown model preset 'gpt3'.*llama"):
        reference_gpt2.train_config("/w", "/w/tokenizer.json", 1, "x", model="gpt3")


def test_suite_reports_every_figure_for_a_tiny_model(tmp_path):
    """The whole command on the tiny preset and 20 files of the corpus (about 30 s on 2 cores)."""
    out = tmp_path / "suite.json"
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "suite.py"), "--models", "tiny", "--steps", "7",
         "--max-files", "20", "--workdir", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr

    for row in (
        "tokens/s, median",
        "step time, median",
        "MFU",
        "start -> step 1, cold",
        "start -> step 1, warm",
        "peak host memory, CLI cold",
        "model FLOPs/token",
        "matmul GFLOP/s, median",
    ):
        assert row in done.stdout, done.stdout
    results = json.loads(out.read_text())
    assert results["machine"]["jax_backend"] == "cpu" and results["machine"]["nproc"] >= 1
    assert len(results["load_average_1_5_15min"]["before"]) == 3

    tiny = results["models"]["tiny"]
    measured = tiny["throughput"]
    assert measured["tokens_per_second"]["median"] > 0
    assert 0 < measured["step_seconds"]["min"] <= measured["step_seconds"]["median"] <= measured["step_seconds"]["max"]
    assert measured["flops_per_token"] > 0
    assert measured["matmul_gflops"]["dtype"] == "float32" and measured["matmul_gflops"]["mean"]["median"] > 0
    assert 0 < measured["mfu"] < 1.5
    assert measured["peak_rss_mib"] > 0
    if len(os.sched_getaffinity(0)) > 1:  # the same run on one core, with its own yardstick
        one_core = tiny["throughput_one_core"]
        assert one_core["tokens_per_second"]["median"] > 0 and one_core["matmul_gflops"]["mean"]["median"] > 0
        assert "one core: tokens/s per matmul GFLOP/s" in done.stdout

    cold, warm = tiny["startup"]["cold"], tiny["startup"]["warm"]
    assert 0 < cold["seconds_to_first_step"] < cold["wall_seconds"]
    assert 0 < warm["seconds_to_first_step"] < warm["wall_seconds"]
    assert cold["compilation_cache"]["entries_before"] == 0
    # the warm start found every program the cold start cached, and compiled nothing it had
    assert warm["compilation_cache"]["entries_before"] == cold["compilation_cache"]["entries_after"]
    assert warm["compilation_cache"]["hits"] == cold["compilation_cache"]["entries_after"]
    assert warm["compilation_cache"]["entries_after"] == warm["compilation_cache"]["entries_before"]


# -- bench/whisper_train.py ----------------------------------------------------------------------


def test_whisper_batch_gives_both_sides_the_same_audio_and_targets():
    preset = whisper_train.PRESETS["test"]
    batch = whisper_train.make_batch(preset)
    rows, seq_len = preset["batch"], preset["model"]["seq_len"]
    window = 2 * preset["model"]["max_source_positions"] * 160  # 1 s
    assert batch["audio"].shape == (rows, window) and batch["tokens"].shape == batch["labels"].shape == (rows, seq_len)
    for row, samples in enumerate(batch["utterances"]):  # theirs: the speech alone; ours: padded with silence
        assert 0 < len(samples) <= window
        assert np.array_equal(batch["audio"][row, : len(samples)], samples)
        assert not batch["audio"][row, len(samples) :].any()
    # transformers' labels are our targets: the next token where the loss mask counts it, else ignored
    scored = batch["loss_mask"] > 0
    assert np.array_equal(batch["labels"][:, :-1][scored[:, :-1]], batch["tokens"][:, 1:][scored[:, :-1]])
    assert (batch["labels"][~scored] == -100).all() and not scored[:, -1].any()


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_whisper_presets_build_the_same_model_on_both_sides(preset):
    """Our model and transformers' have the same parameters, tensor for tensor (shapes only)."""
    import jax
    import torch
    import transformers
    from haliax import Axis

    config = whisper_train.PRESETS[preset]
    ours = whisper_train.our_config(config, "scan", "p=f32", "/nonexistent", 1).model
    shapes = jax.eval_shape(lambda: ours.build(Axis("vocab", config["vocab_size"]), key=jax.random.PRNGKey(0)))
    our_count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
    with torch.device("meta"):
        theirs = transformers.WhisperForConditionalGeneration(whisper_train.hf_config(config))
    assert our_count == sum(p.numel() for p in theirs.parameters())
    if preset == "tiny":  # openai/whisper-tiny's 37.8 M, less 384 of its 448 decoder positions
        assert our_count == 37_760_640 - 384 * 384


def test_whisper_train_reports_both_sides(tmp_path):
    """The whole script on the test preset, with the profile of both steps (about 15 s on 2 cores,
    most of it compiling; torch on one thread, which a busy machine slows least)."""
    out = tmp_path / "whisper.json"
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "whisper_train.py"), "--preset", "test", "--rounds", "2",
         "--steps", "1", "--warmup", "1", "--device", "cpu", "--torch-threads", "1", "--profile",
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for row in ("ours: step time", "transformers: step time", "ratio ours / transformers", "audio s/s"):
        assert row in done.stdout, done.stdout
    results = json.loads(out.read_text())
    assert results["machine"]["jax_backend"] == "cpu" and results["machine"]["torch_device"] == "cpu"
    assert results["machine"]["torch_threads"] == 1
    assert results["parameters"]["ours"] == results["parameters"]["transformers"]
    batch = results["batch"]
    assert batch["window_seconds"] == 2 * 1.0 and 0 < batch["audio_seconds"] <= batch["window_seconds"]
    for side in ("ours", "transformers"):
        figures = results[side]
        assert len(figures["step_seconds"]["all"]) == 2 and len(figures["per_round_median"]) == 2
        step = figures["step_seconds"]["median"]
        assert figures["audio_seconds_per_second"] == pytest.approx(batch["audio_seconds"] / step)
        assert figures["window_seconds_per_second"] == pytest.approx(batch["window_seconds"] / step)
        assert all(np.isfinite(figures["loss_first_last"]))
    theirs = results["transformers"]
    assert 0 < theirs["features_seconds"]["median"] < theirs["step_seconds"]["median"]
    assert results["ratio"]["vs_step_with_features"] == pytest.approx(
        theirs["step_seconds"]["median"] / results["ours"]["step_seconds"]["median"]
    )
    # --profile: the same pieces of both steps, each timed
    profile = results["profile_seconds"]
    assert set(profile["ours"]) == set(profile["transformers"])
    for pieces in profile.values():
        for piece in ("features", "encoder forward + backward", "loss forward + backward", "whole step"):
            assert pieces[piece] > 0, piece
    assert "profile: encoder forward + backward" in done.stdout


# -- bench/lora.py -------------------------------------------------------------------------------


def test_lora_bench_compares_adapters_with_full_fine_tuning(tmp_path):
    """The whole script on the tiny GPT-2 preset, one step a round (about 20 s on 2 cores)."""
    out = tmp_path / "lora.json"
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "lora.py"), "--model", "tiny", "--ranks", "4", "8",
         "--steps", "1", "--rounds", "2", "--warmup", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lora-r8" in done.stdout and "optimizer state" in done.stdout
    results = json.loads(out.read_text())
    assert results["machine"]["jax_backend"] == "cpu" and results["batch"] == {"sequences": 4, "seq_len": 32}
    full, r4, r8 = (results["variants"][name] for name in ("full", "lora-r4", "lora-r8"))
    assert full["trained_parameters"] == full["parameters"]
    # r x (in + out) for each adapted layer of the one block: c_attn 32 -> 96, c_proj 32 -> 32,
    # c_fc 32 -> 128, mlp c_proj 128 -> 32
    assert r8["trained_parameters"] == 2 * r4["trained_parameters"] == 8 * (128 + 64 + 160 + 160)
    assert r8["parameters"] == full["parameters"] + r8["trained_parameters"]
    for v in (full, r4, r8):  # Adam's two moments of every trained parameter, and a few scalars
        assert 0 <= v["optimizer_state_bytes"] - 2 * 4 * v["trained_parameters"] < 1024
        assert len(v["rounds_seconds"]) == 2 and v["step_seconds"] == min(v["rounds_seconds"]) > 0
    # a LoRA checkpoint holds the adapters and their optimizer state; its whole state keeps the base
    assert r8["checkpoint_bytes"] - 3 * 4 * r8["trained_parameters"] < 1024
    assert r8["state_bytes"] - r8["checkpoint_bytes"] == 4 * full["parameters"]
    assert r8["vs_full"]["optimizer_state_bytes"] == pytest.approx(
        r8["optimizer_state_bytes"] / full["optimizer_state_bytes"]
    )
    assert full["vs_full"]["step_seconds"] == 1.0


def test_gpu_script_runs_every_part_on_cpu_with_tiny_models(tmp_path):
    """bench/gpu.sh is run once, on a lent GPU, where a trivial failure costs the whole lease: its
    logic runs here on the tiny presets (a training part and a decoding part, ours and theirs)."""
    out = tmp_path / "gpu"
    done = subprocess.run(
        ["bash", os.path.join(REPO, "bench", "gpu.sh"), "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=400, check=False,
        env={**os.environ, "PYTHON": sys.executable, "SITE": str(tmp_path / "site")},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    train, decode = summary["parts"]["train-tiny"], summary["parts"]["decode-llama"]
    assert train["status"] == "ok" and decode["status"] == "ok", summary
    assert train["figures"]["tokens_per_second"] > 0 and 0 < train["figures"]["mfu_measured_matmul"] < 1.5
    assert train["figures"]["published_peak_tflops"] is None  # a CPU has no published bf16 peak
    for case in decode["figures"]["cases"].values():
        for side in ("levanter", "transformers"):
            assert case[side]["decode_tokens_per_s"] > 0 and case[side]["prefill_tokens_per_s"] > 0
    table = (out / "summary.md").read_text()
    assert "| tiny |" in table and "| batch 1 | levanter |" in table and "| batch 1 | transformers |" in table
    assert "train-tiny" in (out / "gpu.log").read_text()
    # the profiled step's device time, summed by kind of work, comes back with the figures
    profile = train["profile"]
    assert profile["source"] == "CPU XLA operations" and profile["busy_ms_per_step"] > 0, profile
    assert abs(sum(k["share"] for k in profile["kinds"].values()) - 1) < 1e-6
    assert (out / "tiny-trace.json.gz").stat().st_size > 0 and "train-tiny, profiled:" in table


def test_gpu_script_skips_what_the_budget_cannot_hold(tmp_path):
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "gpu.py"), "--quick", "--budget", "5", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr  # nothing ran: no figure to show
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(p["status"].startswith("skipped: 5 s of the budget left") for p in summary["parts"].values())
    assert "- decode-llama: skipped" in (tmp_path / "summary.md").read_text()


def test_published_peaks_tell_the_h100_parts_apart():
    import gpu

    assert gpu.published_peak("NVIDIA H100 80GB HBM3") == 989.4
    assert gpu.published_peak("NVIDIA H100 PCIe") == 756.0
    assert gpu.published_peak("NVIDIA H200") == 989.4 and gpu.published_peak("NVIDIA GH200 480GB") == 989.4
    assert gpu.published_peak("cpu") is None
