"""Pipeline parallelism: the layers split into stages over a ``stage`` mesh axis, the batch fed
through them in microbatches (levanter_core/layers/pipeline.py).

On simulated CPU devices: GPT-2 (its own stack, with a per-layer argument) and Gemma 3 (the
decoder kit, sliding-window flags that differ by layer) over 4 stages; over 2 stages, Qwen3
with FSDP inside each, Llama with its sequences split over 2 context devices too, and Mixtral
(its router's statistics averaged over the microbatches) with its experts over 2 expert
devices, give one device's loss, router terms and gradients with packed documents; and the
circular schedule (2 rounds of 2 stages, FSDP inside) gives them too for Gemma 3, GPT-2 and
GPT-OSS; runs the pipeline cannot serve are refused before they start; ``levanter train`` trains
GPT-2 over 2 stages in the circular schedule, and a checkpoint of it resumes under context
parallelism (no stages, the positions over 2 devices) with the same run's losses up to
rounding."""

import os
import shutil

import pytest
from test_expert_parallel import run_script
from test_resume import attempt

from conftest import REPO, run_cli
from levanter_core.config.train import TrainConfig
from levanter_core.errors import ConfigError
from levanter_core.layers.pipeline import bubble_fraction, default_microbatches
from levanter_core.trainer.checks import check_pipeline_split

PLUGINS = f"{REPO}/plugins"
GPT2 = f"{PLUGINS}/models-gpt2/levanter_model_gpt2/configs/gpt2_nano.yaml"
GEMMA3 = f"{PLUGINS}/models-gemma/levanter_model_gemma/configs/gemma3_nano.yaml"
QWEN3 = f"{PLUGINS}/models-qwen3/levanter_model_qwen3/configs/qwen3_nano.yaml"
MIXTRAL = f"{PLUGINS}/models-mixtral/levanter_model_mixtral/configs/mixtral_nano.yaml"
LLAMA = f"{PLUGINS}/models-llama/levanter_model_llama/configs/llama_nano.yaml"
GPT_OSS = f"{PLUGINS}/models-gpt-oss/levanter_model_gpt_oss/configs/gpt_oss_nano.yaml"
DEEPSEEK = f"{PLUGINS}/models-deepseek/levanter_model_deepseek/configs/deepseek_v3_nano.yaml"
WHISPER = f"{PLUGINS}/models-whisper/levanter_model_whisper/configs/whisper_nano.yaml"


def test_the_bubble_and_the_default_number_of_microbatches():
    assert bubble_fraction(1, 1) == 0.0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(2, 2, repeats=2) == pytest.approx(1 / 5)  # circular: (S - 1) / (R M + S - 1)
    assert bubble_fraction(4, 4, repeats=2) == pytest.approx(3 / 11)
    assert default_microbatches(2, 16) == 8  # up to 4 x stages
    assert default_microbatches(4, 12) == 12
    assert default_microbatches(4, 18) == 9  # the largest divisor of the rows within 16
    assert default_microbatches(8, 1) == 1


@pytest.mark.slow
def test_families_give_one_devices_loss_router_terms_and_gradients_over_stages(tmp_path):
    out = str(tmp_path / "families.json")
    # GPT-2 and Gemma 3 over 4 stages alone; Qwen3 over 2 stages with its parameters FSDP over 4
    # data devices inside each (every dense family passes that layout: bench/RESULTS.md). That
    # layout waits at two collectives at once, which XLA's CPU runtime finishes only with enough
    # threads (simulated_devices sets PJRT_NPROC; levanter_core.trainer.host_threads). The
    # circular schedule (2 stages x 2 data, 2 rounds: a layer a chunk): Gemma 3's per-layer
    # sliding flags move with its chunks, as GPT-2's unnamed per-layer argument does.
    # Mixtral (its experts over 2 expert devices in each stage) and GPT-OSS (2 rounds, FSDP
    # inside): the router's statistics are averaged over the microbatches, which gives the
    # batch's load-balancing and z-losses. Llama with each sequence over 2 context devices in
    # each stage.
    layouts = ("pipeline", GPT2, GEMMA3, f"pipeline_fsdp@{QWEN3}", f"pipeline_context@{LLAMA}")
    layouts += (f"pipeline_expert@{MIXTRAL}", f"pipeline_circular@{GEMMA3}", f"pipeline_circular@{GPT2}")
    layouts += (f"pipeline_circular@{GPT_OSS}",)
    both = run_script("context_parallel_families.py", out, *layouts)
    results = both["results"]
    assert set(results) == {
        "gpt2_nano.yaml",
        "gemma3_nano.yaml",
        "pipeline_expert@mixtral_nano.yaml",
        "pipeline_context@llama_nano.yaml",
        "pipeline_fsdp@qwen3_nano.yaml",
        "pipeline_circular@gemma3_nano.yaml",
        "pipeline_circular@gpt2_nano.yaml",
        "pipeline_circular@gpt_oss_nano.yaml",
    }
    for name, run in results.items():
        assert abs(run["loss_split"] - run["loss_one"]) <= 1e-5 * abs(run["loss_one"]), (name, run)
        assert run["grad_rel_diff"] <= 1e-5, (name, run)
        assert run["packed"], name
        for term, (one, split) in run["router"].items():
            assert split == pytest.approx(one, rel=1e-5), (name, term)
    assert set(results["pipeline_expert@mixtral_nano.yaml"]["router"]) == {
        "moe/load_balancing_loss",
        "moe/router_z_loss",
    }
    assert set(results["pipeline_circular@gpt_oss_nano.yaml"]["router"]) == {
        "moe/load_balancing_loss",
        "moe/router_z_loss",
    }


def config_with(path: str, **trainer) -> TrainConfig:
    from levanter_core.config.train import load_train_config

    overrides = [arg for k, v in trainer.items() for arg in (f"--trainer.{k}", str(v))]
    return load_train_config(path, overrides)[0]


def test_runs_a_pipeline_cannot_serve_are_refused_before_they_start():
    stages = "{axes: {stage: 2}}"
    gpt2 = config_with(GPT2, mesh=stages)
    check_pipeline_split(gpt2.trainer, gpt2.model)  # 4 dense layers, scanned: fine
    for mesh in (stages, "{axes: {stage: 2, expert: 2}, shared_mapping: {experts: expert}}"):
        mixtral = config_with(MIXTRAL, mesh=mesh)
        check_pipeline_split(mixtral.trainer, mixtral.model)  # experts, split over devices or not
    refusals = {
        "does not run its layers as a pipeline": config_with(WHISPER, mesh=stages),
        "do not split into 3 equal pipeline stages": config_with(GPT2, mesh="{axes: {stage: 3}}"),
        # DeepSeek-V3's first layer is dense, the rest a mixture of experts: two stacks, each split
        r"layers \(stacks of 1 dense, then 3 moe\) do not split into 2 equal pipeline stages": config_with(
            DEEPSEEK, mesh=stages
        ),
    }
    refusals["2 stages x 4 rounds cut the layers into 8 chunks"] = config_with(GPT2, mesh=stages, pipeline_repeats=4)
    refusals["needs at least as many microbatches as its 2 stages; got 1"] = config_with(
        GPT2, mesh=stages, pipeline_repeats=2, pipeline_microbatches=1
    )
    for expected, config in refusals.items():
        with pytest.raises(ConfigError, match=expected):
            check_pipeline_split(config.trainer, config.model)
    # 4 rows over 4 data devices: 1 each, which makes 1 microbatch, too few for 2 stages' rounds
    short = config_with(GPT2, mesh="{axes: {stage: 2, data: 4}}", pipeline_repeats=2, train_batch_size=4)
    with pytest.raises(ConfigError, match=r"^trainer.pipeline_repeats: .* holds 1 row\(s\) .* cut by default into 1"):
        check_pipeline_split(short.trainer, short.model, {"stage": 2, "data": 4}, 4)
    unscanned = gpt2.model.model_copy(update={"scan_layers": False})
    with pytest.raises(ConfigError, match=r"^model.scan_layers: .*set model.scan_layers: true"):
        check_pipeline_split(gpt2.trainer, unscanned)
    # 16 rows over 2 data devices: 8 each, which 3 microbatches do not cut
    odd = config_with(GPT2, mesh="{axes: {stage: 2, data: 2}}", pipeline_microbatches=3)
    check_pipeline_split(odd.trainer, odd.model)  # before the devices are known: not yet checked
    with pytest.raises(ConfigError, match=r"^trainer.pipeline_microbatches: .* 8 row\(s\) .* 3 equal microbatches"):
        check_pipeline_split(odd.trainer, odd.model, {"stage": 2, "data": 2}, 2)


def test_levanter_train_refuses_stages_its_stacks_of_layers_cannot_split_by_its_fields(tmp_path):
    result = run_cli(
        "train", DEEPSEEK, "--dry-run", "--trainer.mesh", "{axes: {stage: 2}}",
        "--data.cache_dir", str(tmp_path / "cache"),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert (
        "trainer.mesh.axes.stage: the model's layers (stacks of 1 dense, then 3 moe) do not split into 2 equal "
        "pipeline stages; choose a number of stages that divides 1 and 3"
    ) in result.stderr


STEPS = 6


def gpt2_args(workdir: str, run_id: str, mesh: str) -> list[str]:
    return [
        "train", GPT2, "--no-progress",
        "--model.seq_len", "64", "--model.hidden_dim", "32", "--model.num_heads", "2",
        "--trainer.id", run_id,
        "--trainer.mesh", mesh,
        "--trainer.train_batch_size", "8",
        "--trainer.num_train_steps", str(STEPS),
        "--trainer.steps_per_eval", "1000",
        "--trainer.max_eval_batches", "1",
        "--trainer.log_dir", os.path.join(workdir, "logs"),
        "--trainer.checkpointer.base_path", os.path.join(workdir, "ckpt"),
        "--trainer.checkpointer.keep", "[{every: 3}]",
        "--trainer.checkpointer.save_interval", "1h",
        "--trainer.jax_compilation_cache_dir", os.path.join(workdir, "jax-cache"),
        "--data.cache_dir", os.path.join(workdir, "data-cache"),
        "--data.max_files", "20",
    ]  # fmt: skip


@pytest.mark.slow
def test_levanter_train_over_two_stages_resumes_under_context_parallelism(tmp_path):
    workdir = str(tmp_path)
    # the circular schedule: each stored stage's two layers run in two rounds, a layer a chunk
    circular = [*gpt2_args(workdir, "staged", "{axes: {stage: 2}}"), "--trainer.pipeline_repeats", "2"]
    staged = attempt(circular, workdir, "staged", None, devices=2)
    assert staged.returncode == 0 and f"done: step {STEPS}" in staged.stdout, staged.stderr[-4000:]
    assert "pipeline parallelism: 2 stages, 8 microbatch(es) of 1 row(s)" in staged.stderr
    assert "circular in 2 rounds: the stages idle 6% of each step" in staged.stderr
    expected = staged.losses
    assert sorted(expected) == list(range(1, STEPS + 1)) and expected[STEPS] < expected[1]

    # Step 3's checkpoint, moved to another layout (no stages; each sequence's positions split
    # over 2 context devices) trains on with the same run's losses: the parameters are the same
    # arrays (stored in the layers' order whatever the schedule), split otherwise; the sums add
    # in another order, so within 1e-5, not bit for bit.
    moved = os.path.join(workdir, "ckpt", "moved")
    os.makedirs(moved)
    shutil.copytree(os.path.join(workdir, "ckpt", "staged", "step-3"), os.path.join(moved, "step-3"))
    context = "{axes: {context: 2, data: 1}, shared_mapping: {position: context}}"
    other = attempt(gpt2_args(workdir, "moved", context), workdir, "moved", None, devices=2)
    assert other.returncode == 0 and f"resumed from {moved}/step-3 at step 3" in other.stdout, other.stderr[-4000:]
    assert sorted(other.losses) == list(range(4, STEPS + 1))
    for step, loss in other.losses.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), (step, loss, expected[step])
