"""Expert parallelism: a mixture of experts' experts split over an ``expert`` mesh axis, the
tokens sent to them and back by ``all_to_all`` (levanter_core/layers/expert_parallel.py).

On 8 simulated devices: one layer of each routing kind gives one device's loss and gradients
when dropless, and drops pairs only under a tight capacity factor; every mixture-of-experts
family gives one device's loss and gradients with its experts over 4 devices and its parameters
FSDP over 2, and with experts combined with context or tensor parallelism; ``levanter train``
trains Mixtral with 4 expert devices, resumes bit for bit after ``kill -9``, and a checkpoint
of it resumes under another expert layout with the same run's losses up to rounding."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from test_resume import Kill, attempt, final_arrays

from conftest import REPO, run_cli
from levanter_core.testing import simulated_devices

PLUGINS = f"{REPO}/plugins"
MOE_CONFIGS = {
    "mixtral_nano.yaml": f"{PLUGINS}/models-mixtral/levanter_model_mixtral/configs/mixtral_nano.yaml",
    "qwen3_moe_nano.yaml": f"{PLUGINS}/models-qwen3/levanter_model_qwen3/configs/qwen3_moe_nano.yaml",
    "gpt_oss_nano.yaml": f"{PLUGINS}/models-gpt-oss/levanter_model_gpt_oss/configs/gpt_oss_nano.yaml",
    "deepseek_v3_nano.yaml": f"{PLUGINS}/models-deepseek/levanter_model_deepseek/configs/deepseek_v3_nano.yaml",
}


def run_script(script: str, *args: str) -> dict:
    result = subprocess.run(
        [sys.executable, f"{REPO}/tests/{script}", *args],
        env={**os.environ, **simulated_devices(8, quick_compile=True)}, capture_output=True, text=True, timeout=900,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(open(args[0]).read())


def test_a_split_layer_gives_one_devices_results_and_drops_only_past_its_capacity_and_says_so(tmp_path):
    results = run_script("expert_parallel_layer.py", str(tmp_path / "layer.json"))
    assert results["all_to_all"] == 4  # out and back, in the forward pass and the backward
    for kind in ("softmax_topk", "topk_softmax, biases", "sigmoid_topk, groups, shared"):
        for factor in ("None", "8.0"):  # dropless; a capacity of all 4 devices' share: nothing to drop
            run = results[f"{kind} / {factor}"]
            assert run["loss_split"] == pytest.approx(run["loss_one"], rel=1e-6), (kind, factor, run)
            assert run["grad_rel_diff"] <= 1e-5, (kind, factor, run)
            assert run["dropped_reported"] == 0.0, (kind, factor, run)
        tight = results[f"{kind} / 1.0"]  # room for the balanced share only: some pairs are dropped
        assert tight["grad_rel_diff"] > 1e-2, (kind, tight)
        # and the router's statistics say how many (moe/dropped_pairs), as counted from the routing
        assert tight["dropped_reported"] > 0.05, (kind, tight)
        assert tight["dropped_reported"] == pytest.approx(tight["dropped_expected"], rel=1e-6), (kind, tight)
    assert "6 experts do not split evenly over the 4 devices of the 'expert' mesh axis" in results["six_experts_error"]


def test_experts_that_do_not_divide_over_the_expert_devices_are_refused_before_the_run(tmp_path):
    mesh = "{axes: {expert: 8}, shared_mapping: {experts: expert}}"  # Mixtral nano: 4 experts
    cache = str(tmp_path / "cache")
    result = run_cli(
        "train", MOE_CONFIGS["mixtral_nano.yaml"], "--dry-run", "--trainer.mesh", mesh, "--data.cache_dir", cache
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "trainer.mesh.axes.expert = 8 devices, but the model has 4 experts per layer" in result.stderr


@pytest.mark.slow
def test_every_moe_family_gives_one_devices_loss_and_gradients_with_experts_split(tmp_path):
    out = str(tmp_path / "families.json")
    combos = [
        f"expert_context@{MOE_CONFIGS['qwen3_moe_nano.yaml']}",
        f"expert_model@{MOE_CONFIGS['gpt_oss_nano.yaml']}",
    ]
    results = run_script("context_parallel_families.py", out, "expert", *MOE_CONFIGS.values(), *combos)["results"]
    assert set(results) == {*MOE_CONFIGS, "expert_context@qwen3_moe_nano.yaml", "expert_model@gpt_oss_nano.yaml"}
    for name, run in results.items():
        assert abs(run["loss_split"] - run["loss_one"]) <= 1e-5 * abs(run["loss_one"]), (name, run)
        assert run["grad_rel_diff"] <= 1e-5, (name, run)
        assert run["packed"], name


STEPS = 8
MESH_EP4 = "{axes: {expert: 4}, shared_mapping: {experts: expert}}"
MESH_EP2 = "{axes: {expert: 2, data: 2}, shared_mapping: {experts: expert}}"


def mixtral_args(workdir: str, run_id: str, mesh: str) -> list[str]:
    return [
        "train", MOE_CONFIGS["mixtral_nano.yaml"], "--no-progress",
        "--model.seq_len", "64", "--model.num_layers", "2",
        "--trainer.id", run_id,
        "--trainer.mesh", mesh,
        "--trainer.train_batch_size", "8",
        "--trainer.num_train_steps", str(STEPS),
        "--trainer.steps_per_eval", "1000",
        "--trainer.max_eval_batches", "1",
        "--trainer.log_dir", os.path.join(workdir, "logs"),
        "--trainer.checkpointer.base_path", os.path.join(workdir, "ckpt"),
        "--trainer.checkpointer.keep", "[{every: 2}]",
        "--trainer.checkpointer.save_interval", "1s",
        "--trainer.jax_compilation_cache_dir", os.path.join(workdir, "jax-cache"),
        "--data.cache_dir", os.path.join(workdir, "data-cache"),
        "--data.max_files", "20",
    ]  # fmt: skip


@pytest.mark.slow
def test_levanter_train_with_four_expert_devices_resumes_after_kill_bit_for_bit(tmp_path):
    workdir = str(tmp_path)
    reference = attempt(mixtral_args(workdir, "uninterrupted", MESH_EP4), workdir, "uninterrupted", None, devices=4)
    assert reference.returncode == 0 and f"done: step {STEPS}" in reference.stdout, reference.stderr[-4000:]
    expected = reference.losses
    assert sorted(expected) == list(range(1, STEPS + 1))

    args = mixtral_args(workdir, "killed", MESH_EP4)
    killed = attempt(args, workdir, "killed", Kill("on_write", 4), devices=4)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    final = attempt(args, workdir, "killed", None, devices=4)
    assert final.returncode == 0 and f"done: step {STEPS}" in final.stdout, final.stderr[-4000:]
    assert final.resumed and final.resumed[0][1] >= 2 and final.resumed[0][2], final.resumed
    for a in (killed, final):
        assert "Traceback" not in a.stderr, a.stderr[-4000:]
        for step, loss in a.losses.items():
            assert loss == expected[step], f"step {step}: {loss!r} after resuming, {expected[step]!r} uninterrupted"
    want = final_arrays(os.path.join(workdir, "ckpt", "uninterrupted", f"step-{STEPS}"))
    found = final_arrays(os.path.join(workdir, "ckpt", "killed", f"step-{STEPS}"))
    assert sorted(found) == sorted(want)
    for name, array in want.items():
        assert found[name].tobytes() == array.tobytes(), f"{name} differs from the uninterrupted run's"

    # The checkpoint of step 4, moved under another layout (2 expert x 2 data), trains on with the
    # same run's losses: not bit for bit (sums split otherwise round otherwise), within 1e-5.
    moved = os.path.join(workdir, "ckpt", "moved")
    os.makedirs(moved)
    shutil.copytree(os.path.join(workdir, "ckpt", "uninterrupted", "step-4"), os.path.join(moved, "step-4"))
    other = attempt(mixtral_args(workdir, "moved", MESH_EP2), workdir, "moved", None, devices=4)
    assert other.returncode == 0 and f"resumed from {moved}/step-4 at step 4" in other.stdout, other.stderr[-4000:]
    assert sorted(other.losses) == list(range(5, STEPS + 1))
    for step, loss in other.losses.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), (step, loss, expected[step])
