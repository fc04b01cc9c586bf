"""Axis mappings on 8 simulated CPU devices: FSDP, tensor parallelism, both, and replicas
train to the same losses as one device, with parameters and optimizer state stored split as
configured; mappings that cannot work fail before compiling, naming the field.

The devices are simulated in subprocesses (this pytest process keeps its single device)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, code_docs, run_cli, run_config, write_jsonl
from levanter_core.config.train import load_train_config
from levanter_core.testing import simulated_devices

# every run compared here is a subprocess with one of these, so each may compile at the lowest level
EIGHT_DEVICES = simulated_devices(8, quick_compile=True)
ONE_DEVICE = simulated_devices(1, quick_compile=True)

# float32, every dimension the mesh splits divisible by 8
MODEL = {"type": "gpt2", "hidden_dim": 64, "num_heads": 8, "num_layers": 2, "seq_len": 32}
TP = ["--trainer.tensor_parallel_axes", "[mlp, heads]"]

SETTINGS = {
    "fsdp": ([], {"embed": "data"}),
    "tensor-parallel": (
        ["--trainer.model_axis_size", "8", "--trainer.fsdp_axis", "null", *TP],
        {"mlp": "model", "heads": "model"},
    ),
    "fsdp-and-tp": (["--trainer.model_axis_size", "2", *TP], {"embed": "data", "mlp": "model", "heads": "model"}),
    # context parallelism: each sequence's 32 positions split 4 ways (ring attention), and 2 ways
    # beside tensor parallelism (attention from gathered keys and values)
    "context-parallel": (
        ["--trainer.mesh", "{axes: {context: 4}, shared_mapping: {position: context}}"],
        # shared_mapping splits GPT-2's learned position embeddings too
        {"embed": "data", "mlp": "model", "heads": "model", "position": "context"},
    ),
    "context-and-tp": (
        ["--trainer.mesh", "{axes: {context: 2, model: 2}, shared_mapping: {position: context}}",
         "--trainer.context_attention", "all_gather"],
        {"embed": "data", "mlp": "model", "heads": "model", "position": "context"},
    ),
    "replica-fsdp-tp": (
        ["--trainer.replica_ici_axis_size", "2", "--trainer.model_axis_size", "2", *TP],
        {"embed": "data", "mlp": "model", "heads": "model"},
    ),
}  # fmt: skip
"""name -> (overrides, where each parameter axis must be stored: logical axis -> mesh axis)."""
MESH_FSDP_AND_TP = ["--trainer.mesh", "{axes: {model: 2}}"]
"""fsdp-and-tp in Levanter's spelling, whose defaults split mlp and heads over model and embed
over data: the same mesh and mappings, which are all a run reads of either spelling, so it is
not trained again."""


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharding")
    data = {
        "type": "url",
        "train_urls": [write_jsonl(tmp / "train.jsonl", code_docs(300))],
        "validation_urls": [write_jsonl(tmp / "valid.jsonl", code_docs(40, offset=300))],
        "cache_dir": str(tmp / "cache"),
    }
    return run_config(tmp, data, run_id="sharding", steps=10, model=MODEL, train_batch_size=8, mp="p=f32")


def train_settings(config, tmp_path, env, runs: dict[str, list[str]]) -> dict:
    """Train ``config`` with each list of overrides in ``runs``, in one subprocess with ``env``."""
    runs_path, out_path = tmp_path / "runs.json", tmp_path / "out.json"
    runs_path.write_text(json.dumps(runs))
    result = subprocess.run(
        [sys.executable, f"{REPO}/tests/sharding_run.py", config, str(runs_path), str(out_path)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out_path.read_text())


def assert_close(losses: dict, reference: dict, what: str):
    assert losses.keys() == reference.keys(), what
    for step, expected in reference.items():
        assert abs(losses[step] - expected) <= 1e-5 * abs(expected), f"{what} at step {step}"


@pytest.fixture(scope="module")
def one_device(config, tmp_path_factory):
    """The reference: the same config on one device, with batches of 8 and 12."""
    runs = {"one-device": [], "one-device-12": ["--trainer.train_batch_size", "12"]}
    return train_settings(config, tmp_path_factory.mktemp("one"), ONE_DEVICE, runs)


@pytest.mark.slow
def test_sharded_runs_match_one_device_and_store_parameters_split(config, one_device, tmp_path):
    eight = train_settings(config, tmp_path, EIGHT_DEVICES, {name: args for name, (args, _) in SETTINGS.items()})
    assert (one_device["devices"], eight["devices"]) == (1, 8)
    for name, (_, placement) in SETTINGS.items():
        run = eight[name]
        assert len(run["train"]) == 10 and len(run["eval"]) >= 2, name
        assert_close(run["train"], one_device["one-device"]["train"], f"{name}: train/loss")
        assert_close(run["eval"], one_device["one-device"]["eval"], f"{name}: eval/loss")
        # every parameter and optimizer-state array (Adam's mu and nu) is stored as configured
        assert any(".mu." in path for path in run["arrays"]), name
        for path, array in run["arrays"].items():
            assert array["axes"] == {axis: placement.get(axis) for axis in array["axes"]}, (name, path)

    # one device's piece of the MLP weight (layers, mlp, embed) = (2, 256, 64), over data 4 x model 2
    pieces = {
        path: a["piece"] for path, a in eight["fsdp-and-tp"]["arrays"].items() if path.endswith("mlp.c_fc.weight")
    }
    assert len(pieces) == 3 and set(map(tuple, pieces.values())) == {(2, 128, 16)}

    # Levanter's spelling resolves to the same mesh and mappings, from which the trainer places
    # every array: one code path (the mesh itself on 8 devices: tests/test_mesh_config.py)
    own = load_train_config(config, SETTINGS["fsdp-and-tp"][0])[0].trainer
    levanter = load_train_config(config, MESH_FSDP_AND_TP)[0].trainer
    assert levanter.mesh is not None and own.mesh is None
    assert levanter.resolved_mesh.resolved_sizes(8) == own.resolved_mesh.resolved_sizes(8)
    assert levanter.compute_axis_mapping() == own.compute_axis_mapping()
    assert levanter.parameter_axis_mapping() == own.parameter_axis_mapping()


@pytest.mark.slow
def test_a_batch_the_devices_do_not_divide_trains_to_the_same_losses_when_allowed(config, one_device, tmp_path):
    uneven = ["--trainer.train_batch_size", "12", "--trainer.allow_nondivisible_batch_size", "true"]
    run = train_settings(config, tmp_path, EIGHT_DEVICES, {"uneven-batch": uneven})["uneven-batch"]
    assert_close(run["train"], one_device["one-device-12"]["train"], "train/loss")
    assert_close(run["eval"], one_device["one-device-12"]["eval"], "eval/loss")


ERRORS = {
    "model-axis": (["--trainer.model_axis_size", "3"], ["trainer.model_axis_size (3)", "8 available device"]),
    "batch": (
        ["--trainer.train_batch_size", "12"],
        ["trainer.train_batch_size (12)", "8 data-parallel", "trainer.allow_nondivisible_batch_size"],
    ),
    "axis-typo": (["--trainer.tensor_parallel_axes", "[mlp, head]"],
                  ["trainer.tensor_parallel_axes", "'head'", "Did you mean 'heads'?", "heads, layers, mlp"]),
    "mesh-axis": (["--trainer.axis_resources", "{mlp: modle}"], ["trainer.axis_resources", "'modle'", "replica_dcn"]),
    "uneven-parameter": (
        ["--trainer.model_axis_size", "8", "--trainer.tensor_parallel_axes", "[vocab]"],
        ["trainer.tensor_parallel_axes", "'vocab'", "size 257", "model (8)"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", ERRORS)
def test_mappings_that_cannot_work_exit_2_naming_the_field_before_any_step(config, case):
    args, expected = ERRORS[case]
    result = run_cli("train", config, "--no-progress", "--trainer.id", f"bad-{case}", *args, env=EIGHT_DEVICES)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in result.stderr, (text, result.stderr)
    metrics = Path(config).parent / "logs" / f"bad-{case}" / "metrics.jsonl"
    assert not metrics.exists() or "train/loss" not in metrics.read_text()
