"""The benchmark suite (bench/suite.py): its presets and one whole run on a tiny model."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))

import reference_gpt2  # noqa: E402


def parameters(model: str) -> int:
    from levanter_core.config.loader import Sources
    from levanter_core.config.train import validate_train_config

    raw = reference_gpt2.train_config("/nonexistent", "/nonexistent/tokenizer.json", 1, "count", model=model)
    return reference_gpt2.parameter_count(validate_train_config(raw, Sources("test")), reference_gpt2.VOCAB_SIZE)


def test_llama_preset_is_the_size_of_the_reference_gpt2():
    gpt2, llama = parameters("gpt2"), parameters("llama")
    assert abs(llama - gpt2) / gpt2 < 0.01, (gpt2, llama)
    assert 330e6 < parameters("llama350m") < 370e6


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

    for row in ("tokens/s, median", "step time, median", "MFU", "start -> step 1, cold", "start -> step 1, warm",
                "peak host memory, CLI cold", "model FLOPs/token", "matmul GFLOP/s, median"):
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
