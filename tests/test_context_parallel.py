"""Context parallelism: the positions of each sequence split over a ``context`` mesh axis.

Attention computed as a ring or from gathered keys and values gives, on 8 simulated devices
(2 data x 4 context), the output and the gradients of one device's attention within 1e-6 of
their scale, for every kind of attention the families use (multi-head, grouped-query, packed
documents, sliding windows switched on and off, sinks, soft-capped logits, latent attention
whose values have their own head size)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, run_cli
from levanter_core.testing import simulated_devices


@pytest.fixture(scope="module")
def attention_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("context-parallel") / "attention.json"
    result = subprocess.run(
        [sys.executable, f"{REPO}/tests/context_parallel_attention.py", str(out)],
        env={**os.environ, **simulated_devices(8, quick_compile=True)}, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def test_split_attention_gives_one_devices_output_and_gradients(attention_results):
    assert attention_results["devices"] == 8
    results = attention_results["results"]
    assert len(results) == 16  # 8 kinds of attention x 2 strategies
    for name, result in results.items():
        assert result["max_diff"] <= 1e-6 * result["scale"], (name, result)
        # and it was computed split: the ring passes blocks around, the other gathers them
        expected = ["ppermute"] if name.endswith("/ring") else ["all_gather", "ppermute"]
        assert result["collectives"] == expected, (name, result["collectives"])


# Two families whose attention differs most from the plain kind (bench/context_parallel.py runs
# all of them, with both strategies): Gemma 2 (sliding windows on alternate layers, soft-capped
# logits, local rotary) and DeepSeek-V3 (latent attention, experts). GPT-2 trains split through
# `levanter train` in tests/test_sharding.py.
FAMILIES = {
    "gemma2_nano.yaml": "models-gemma/levanter_model_gemma",
    "deepseek_v3_nano.yaml": "models-deepseek/levanter_model_deepseek",
}


def test_families_train_on_split_sequences_as_on_one_device(tmp_path):
    out = tmp_path / "families.json"
    configs = [f"{REPO}/plugins/{package}/configs/{name}" for name, package in FAMILIES.items()]
    # with FSDP and tensor parallelism too: 2 data x 2 context x 2 model
    configs.append(f"fsdp_context_model@{REPO}/plugins/models-llama/levanter_model_llama/configs/llama_nano.yaml")
    result = subprocess.run(
        [sys.executable, f"{REPO}/tests/context_parallel_families.py", str(out), "ring", *configs],
        env={**os.environ, **simulated_devices(8, quick_compile=True)}, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {*FAMILIES, "fsdp_context_model@llama_nano.yaml"}
    for name, run in results.items():
        assert abs(run["loss_split"] - run["loss_one"]) <= 1e-5 * abs(run["loss_one"]), (name, run)
        assert run["grad_rel_diff"] <= 1e-5, (name, run)
        assert run["packed"], name


def test_a_sequence_that_does_not_cut_into_two_chunks_per_device_is_refused(tmp_path):
    config = tmp_path / "nano.yaml"
    config.write_text(open(f"{REPO}/config/gpt2_nano.yaml").read().replace("cache/stdlib/", f"{tmp_path}/cache/"))
    mesh = "{axes: {context: 6}, shared_mapping: {position: context}}"  # 256 positions, 12 chunks
    result = run_cli("train", str(config), "--dry-run", "--trainer.mesh", mesh)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "train_seq_len: 256 positions do not cut into 12 equal chunks" in result.stderr
    assert "trainer.mesh.shared_mapping.position" in result.stderr and "trainer.mesh.axes.context = 6" in result.stderr
