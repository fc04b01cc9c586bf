"""``levanter plan``: the training step compiled for simulated devices, and what it says about
memory, communication and time on accelerators this machine does not have."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from conftest import REPO, code_docs, run_cli, run_config, write_jsonl
from levanter_core.plan.hardware import ACCELERATORS, accelerator, from_device_kind
from levanter_core.plan.hlo import Collective, collectives, execution_counts

NANO = os.path.join(REPO, "config", "llama_nano.yaml")
NANO_PARAMETERS = 804_224  # config/llama_nano.yaml with the byte tokenizer's 257 tokens


def _plan(*args: str) -> dict:
    done = run_cli("plan", NANO, "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_plan_of_fsdp_over_four_devices_against_one():
    """Four devices split the parameters and optimizer state four ways (FSDP over ``data``) and
    gather them back for the layers; one device holds everything and sends nothing."""
    blocks = ("--model.cross_entropy_block_size", "64")  # the loss in 64 blocks of 64 tokens
    four = _plan("--devices", "4", "--device", "h100", *blocks)
    one = _plan("--devices", "1", "--device", "h100", *blocks)
    assert four["parameters"] == one["parameters"] == NANO_PARAMETERS
    assert four["mesh"] == {"data": 4} and four["batch_size"] == 16 and four["seq_len"] == 256
    m4, m1 = four["memory"], one["memory"]
    assert m1["parameters"] == 4 * NANO_PARAMETERS  # f32
    assert m4["parameters"] == m1["parameters"] / 4 and m4["gradients"] == m4["parameters"]
    assert 2 * m4["parameters"] <= m4["optimizer"] <= 2 * m4["parameters"] + 64  # Adam's two moments and a count
    # each device keeps a quarter of the batch's activations
    assert m4["activations"] == pytest.approx(m1["activations"] / 4, rel=0.01)
    assert m4["peak"] < m1["peak"] and four["fits"] and one["fits"]
    assert m4["peak"] >= m4["arguments"] + m4["temporaries"] - m4["aliased"]

    # the parameters are gathered for the forward and the backward pass: at least twice 3/4 of them
    gathered = four["communication"]["by_kind"]["all-gather"]
    assert gathered >= 2 * 0.75 * m1["parameters"] * 0.9, four["communication"]
    assert four["communication"]["network_bytes"] == 0  # 4 devices fit in one 8-GPU node
    # the gradients are summed over the devices once: the head's gradient is not reduced block by
    # block of the loss (64 all-reduces of it before RowShards; 17 MB here instead of 4.8)
    assert four["communication"]["by_kind"]["all-reduce"] <= 2 * 0.75 * m1["parameters"] * 1.05
    assert one["communication"]["by_kind"] == {} and one["timing"]["communication_s"] == 0

    # the roofline: the same FLOPs, a quarter of them on each of four devices
    assert (
        four["model_flops_per_step"] == one["model_flops_per_step"] == pytest.approx(16 * 256 * one["flops_per_token"])
    )
    t4, t1 = four["timing"], one["timing"]
    assert t4["compute_s"] == pytest.approx(t1["compute_s"] / 4)
    assert 0 < t4["mfu"] <= 0.5 and t4["step_s"] >= t4["compute_s"]


def test_plan_says_what_does_not_fit_and_prints_for_people():
    done = run_cli(
        "plan", NANO, "--devices", "1", "--device", "tpu-v5e", "--trainer.train_batch_size", "2048",
        "--trainer.per_device_eval_parallelism", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "on 1 x Google TPU v5e: mesh data 1" in out and "batch 2048 x 256 tokens" in out
    assert "DOES NOT FIT" in out and "of 14.16 GiB usable" in out, out
    for line in ("parameters", "optimizer state", "gradients", "activations", "temporaries", "predicted step"):
        assert line in out


def test_plan_refuses_an_unknown_accelerator_and_a_bad_mesh():
    done = run_cli("plan", NANO, "--devices", "4", "--device", "h300")
    assert done.returncode == 2 and "--device 'h300' is not an accelerator" in done.stderr
    assert "h100-80gb" in done.stderr and "Traceback" not in done.stderr
    done = run_cli("plan", NANO, "--devices", "4", "--trainer.mesh.axes", "{model: 3}")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "model" in done.stderr


def test_accelerator_table():
    for acc in ACCELERATORS.values():
        assert acc.sources and acc.memory_bytes > 10**10 and acc.bf16_tflops >= 197
        assert acc.link_gb_s > acc.network_gb_s
    assert accelerator("H100").name == "NVIDIA H100 SXM 80GB" and accelerator("v5p") is ACCELERATORS["tpu-v5p"]
    assert from_device_kind("NVIDIA H200") is ACCELERATORS["h200"]
    assert from_device_kind("TPU v5 lite") is ACCELERATORS["tpu-v5e"] and from_device_kind("cpu") is None


HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[64,32]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %ar = bf16[16]{0} all-reduce(%y), channel_id=2, replica_groups=mesh['data'=2,'model'=4] {'data'}, to_apply=%add
  %inner = (s32[], f32[8]) while(%t), condition=%cond2, body=%body2, backend_config={"known_trip_count":{"n":"3"}}
}

%body2 (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %cp = f32[10]{0} collective-permute(%z), channel_id=3, source_target_pairs={{0,1},{1,0}}
}

%cond (p: (s32[], f32[8])) -> pred[] {
}

%cond2 (p: (s32[], f32[8])) -> pred[] {
}

%add (a: bf16[], b: bf16[]) -> bf16[] {
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"16"}}
  %rs = f32[4]{0} reduce-scatter(%v), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
"""


def test_collectives_are_weighed_by_loop_trip_counts_and_grouped():
    counts = execution_counts(HLO)
    assert counts["main"] == 1 and counts["body"] == 16 and counts["body2"] == 48
    found = {c.kind: c for c in collectives(HLO, 8)}
    assert found["all-gather"] == Collective("all-gather", 64 * 32 * 4, 16, (0, 1, 2, 3))
    assert found["all-reduce"].group == (0, 4) and found["all-reduce"].result_bytes == 32
    assert found["collective-permute"].count == 48 and found["collective-permute"].group == (0, 1)
    assert found["reduce-scatter"].group_size == 8
    # ring traffic: a gather sends 3/4 of its result, a reduction twice half, a scatter 7/8 of its input
    assert found["all-gather"].sent_bytes() == 64 * 32 * 4 * 3 / 4
    assert found["all-reduce"].sent_bytes() == 2 * 32 / 2
    assert found["reduce-scatter"].sent_bytes() == 4 * 4 * 8 * 7 / 8


def test_plan_check_stops_a_run_that_would_not_fit_before_allocating(tmp_path):
    """``trainer.plan_check``: a run whose step fits says so and trains; one whose state alone
    is a terabyte stops with the plan's numbers (exit 2), having allocated and saved nothing."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_jsonl(data_dir / "train.jsonl", code_docs(40))
    data = {"train_urls": [str(data_dir / "train.jsonl")], "cache_dir": str(tmp_path / "cache")}
    config = run_config(tmp_path, data, steps=2, plan_check=True)

    done = run_cli("train", config, "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "plan check: peak" in done.stdout and "usable on this machine's CPU: fits" in done.stdout

    huge = ["--model.hidden_dim", "16384", "--model.num_heads", "128", "--model.num_layers", "24"]
    done = run_cli("train", config, "--no-progress", "--trainer.id", "huge", *huge)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "trainer.plan_check: this run will not fit: peak" in done.stderr and "Traceback" not in done.stderr
    assert not os.path.exists(tmp_path / "ckpt" / "huge") or not os.listdir(tmp_path / "ckpt" / "huge")


def test_search_ranks_layouts_and_apply_writes_the_fastest(tmp_path):
    """``--search`` plans tensor parallelism, checkpointing policies and microbatches, fastest
    fitting first (recomputation costs time: saving everything wins where it fits); ``--apply``
    writes the config with the winner's overrides."""
    planned = tmp_path / "planned.yaml"
    done = run_cli(
        "plan", NANO, "--devices", "2", "--search", "--apply", str(planned), "--trainer.train_batch_size", "4"
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # three policies (the config's false, true, recompute) x tensor 1 with 1 or 2 microbatches,
    # or tensor 2 (one data-parallel device) with 1, 2 or 4
    assert "searched 15 layouts on 2 x NVIDIA H100 SXM 80GB: 15 fit" in out, out
    first = out.splitlines()[2]
    assert first.strip() == "--model.gradient_checkpointing false", out
    assert f"wrote {planned}" in out
    text = planned.read_text()
    assert text.startswith("# ") and "--model.gradient_checkpointing false" in text.splitlines()[0]
    config = yaml.safe_load(text)
    assert config["model"]["gradient_checkpointing"] is False and config["trainer"]["train_batch_size"] == 4
    done = run_cli("plan", NANO, "--apply", str(planned))
    assert done.returncode == 2 and "add --search" in done.stderr


def test_search_names_the_smallest_device_count_that_fits(tmp_path):
    """A 2.4 B-parameter model's state (16 bytes a parameter with Adam) does not fit one 40 GB A100
    whatever the layout, which the plan says without compiling; FSDP over two does."""
    config = tmp_path / "big.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data": {"type": "python_stdlib", "tokenizer": "byte"},
                "model": {"type": "gpt2", "hidden_dim": 8192, "num_heads": 64, "num_layers": 3, "seq_len": 64},
                "trainer": {"train_batch_size": 8},
            }
        )
    )
    done = run_cli("plan", str(config), "--devices", "1", "--device", "a100-40gb", "--search")
    assert done.returncode == 0, done.stderr
    assert "0 fit, 9 do not fit" in done.stdout and "no layout fits on 1 devices" in done.stdout
    assert "the smallest count that fits: 2 devices" in done.stdout, done.stdout


def test_plan_of_lora_dpo_and_whisper_runs():
    """LoRA trains (and keeps optimizer state for) the adapters alone; DPO keeps a reference model
    and runs the model on two sequences a row; Whisper's step takes audio features."""
    full = _plan("--devices", "1")
    lora = _plan("--devices", "1", "--lora.r", "8")
    assert lora["parameters"] > full["parameters"] and 0 < lora["trainable_parameters"] < full["parameters"] / 5
    assert lora["memory"]["gradients"] == 4 * lora["trainable_parameters"]  # f32 adapters
    assert lora["memory"]["optimizer"] <= 2 * lora["memory"]["gradients"] + 64

    dpo = _plan("--devices", "1", "--objective", "{type: dpo}")
    assert dpo["memory"]["reference"] == dpo["memory"]["parameters"] == full["memory"]["parameters"]
    assert dpo["memory"]["activations"] > 1.5 * full["memory"]["activations"]  # chosen and rejected

    done = run_cli("plan", os.path.join(REPO, "config", "whisper_nano.yaml"), "--devices", "1", "--json")
    assert done.returncode == 0, done.stderr
    whisper = json.loads(done.stdout)
    assert whisper["model"] == "whisper" and whisper["fits"] and whisper["memory"]["temporaries"] > 0
