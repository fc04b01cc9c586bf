"""What Levanter's config fields do here: each changes something a user would notice (a loss, a
metric, a file, an error), and leaving it out changes nothing."""

from __future__ import annotations

import glob
import os

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import code_docs, metrics, run_config, write_jsonl
from levanter_core.config.base import validate_section
from levanter_core.config.train import load_train_config
from levanter_core.errors import CheckpointError, ConfigError
from levanter_core.models.lm import LmExample, lm_loss_and_metrics
from levanter_core.run import run_training

LLAMA = {
    "type": "llama", "seq_len": 32, "hidden_dim": 32, "intermediate_dim": 64, "num_layers": 4,
    "num_heads": 4, "num_kv_heads": 2,
}  # fmt: skip
Vocab = hax.Axis("vocab", 64)


def _tokens(seq_len: int = 32, rows: int = 2):
    ids = jax.random.randint(jax.random.PRNGKey(1), (rows, seq_len), 0, Vocab.size)
    return hax.named(ids, ("batch", "position"))


def _loss_and_grads(model_fields: dict, **loss_kwargs):
    config = validate_section("model", {**LLAMA, **model_fields})
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    example = LmExample(_tokens(config.seq_len))
    (loss, metrics), grads = eqx.filter_value_and_grad(
        lambda m: lm_loss_and_metrics(m, example, **loss_kwargs), has_aux=True
    )(model)
    return float(loss), metrics, jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))


@pytest.fixture(scope="module")
def default_loss_and_grads():
    """:func:`_loss_and_grads` of ``LLAMA`` as it is (gradient checkpointing on, its default), computed
    once: the reference several tests compare a changed field with."""
    return _loss_and_grads({})


# -- model fields ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [False, "nested", "recompute", "full", "save_all"])
def test_every_gradient_checkpointing_policy_gives_the_same_gradients(policy, default_loss_and_grads):
    loss, _, grads = default_loss_and_grads  # gradient_checkpointing: true
    other_loss, _, other = _loss_and_grads({"gradient_checkpointing": policy})
    assert other_loss == pytest.approx(loss, abs=1e-6)
    for a, b in zip(grads, other):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_an_unknown_gradient_checkpointing_policy_is_refused():
    with pytest.raises(Exception, match="gradient_checkpointing"):
        validate_section("model", {**LLAMA, "gradient_checkpointing": "sometimes"})


@pytest.mark.parametrize(
    "name, ours",
    [(None, "auto"), ("default", "auto"), ("jax_flash", "auto"), ("vanilla", "reference"), ("nvte", "jax")],
)
def test_levanter_attention_backend_names_are_read(name, ours):
    assert validate_section("model", {**LLAMA, "attn_backend": name}).attn_backend == ours
    assert validate_section("model", {"type": "gpt2", "attn_backend": name}).attn_backend == ours


def test_flash_attention_block_size_and_upcast_keep_the_loss(default_loss_and_grads):
    loss, _, _ = default_loss_and_grads
    blocked, _, _ = _loss_and_grads({"flash_attention_block_size": 8})
    upcast, _, _ = _loss_and_grads({"upcast_attn": True})
    assert blocked == pytest.approx(loss, abs=1e-5) and upcast == pytest.approx(loss, abs=1e-5)
    gpt2 = validate_section("model", {"type": "gpt2", "flash_attention_block_size": 8, "seq_len": 32})
    assert gpt2.flash_attention_block_size == 8


def test_layer_norms_without_weights():
    config = validate_section("model", {**LLAMA, "use_layer_norm_weight": False})
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    assert model.model.norm.weight is None and model.model.layers.stacked.input_layernorm.weight is None
    with_weights = validate_section("model", LLAMA).build(Vocab, key=jax.random.PRNGKey(0))
    # a unit scale is the same function: the outputs agree
    tokens = _tokens()
    np.testing.assert_allclose(model(tokens).array, with_weights(tokens).array, atol=1e-5)


def test_default_rope_with_a_factor_scales_positions_like_linear():
    default = validate_section("model", {**LLAMA, "rope": {"type": "default", "factor": 2.0}}).rope
    linear = validate_section("model", {**LLAMA, "rope": {"type": "linear", "factor": 2.0}}).rope
    np.testing.assert_array_equal(default.inverse_frequencies(8), linear.inverse_frequencies(8))
    assert default.to_hf()["rope_type"] == "linear"
    plain = validate_section("model", {**LLAMA, "rope": {"type": "default", "factor": 1.0}}).rope
    assert plain.to_hf()["rope_type"] == "default"


# -- the loss ----------------------------------------------------------------------------------


def test_z_loss_adds_weight_times_the_squared_normalizer(default_loss_and_grads):
    plain, plain_metrics, _ = default_loss_and_grads
    weighted, metrics, grads = _loss_and_grads({}, z_loss_weight=0.1)
    assert "train/z_loss" not in plain_metrics
    z = float(metrics["train/z_loss"])
    assert z > 0 and weighted == pytest.approx(plain + 0.1 * z, rel=1e-5)
    # the gradient of the z-loss term is that of z * logsumexp^2 (checked against autodiff)
    config = validate_section("model", LLAMA)
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    tokens = _tokens()

    def direct(m):
        logits = m(tokens).array.astype(jnp.float32)[:, :-1]
        targets = tokens.array[:, 1:]
        lse = jax.nn.logsumexp(logits, axis=-1)
        ce = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(ce + 0.1 * lse**2)

    expected = jax.tree.leaves(eqx.filter(eqx.filter_grad(direct)(model), eqx.is_inexact_array))
    for a, b in zip(grads, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


# -- optimizer ---------------------------------------------------------------------------------


def test_cooldown_ends_the_schedule_with_a_linear_phase_and_haps_is_refused():
    adam = {"type": "adam", "learning_rate": 1.0, "warmup": 0, "min_lr_ratio": 0.0, "lr_schedule": "constant"}
    with pytest.warns(DeprecationWarning, match="cooldown"):
        schedule = validate_section("optimizer", {**adam, "cooldown": 0.2}).lr_scheduler(100)
    assert float(schedule(0)) == pytest.approx(1.0) and float(schedule(79)) == pytest.approx(1.0)
    assert float(schedule(90)) == pytest.approx(0.5, abs=0.06) and float(schedule(100)) == pytest.approx(0.0, abs=1e-6)
    assert float(validate_section("optimizer", adam).lr_scheduler(100)(90)) == pytest.approx(1.0)
    validate_section("optimizer", {**adam, "haps": None})
    with pytest.raises(Exception, match="cycles"):
        validate_section("optimizer", {**adam, "haps": [100, 200]})


# -- trainer fields that refuse ------------------------------------------------------------------


def _write_run(tmp_path, data_from=None, **trainer):
    """A tiny run's config in ``tmp_path``; its data files and cache are written there too, or
    are those under ``data_from`` (:func:`built_data`'s)."""
    data_dir = (data_from or tmp_path) / "data"
    if data_from is None:
        data_dir.mkdir(exist_ok=True)
        write_jsonl(data_dir / "train.jsonl", code_docs(60))
        write_jsonl(data_dir / "valid.jsonl", code_docs(8, offset=500))
    data = {"train_urls": [str(data_dir / "train.jsonl")], "validation_urls": [str(data_dir / "valid.jsonl")],
            "cache_dir": str((data_from or tmp_path) / "cache")}  # fmt: skip
    return run_config(tmp_path, data, **trainer)


@pytest.fixture(scope="module")
def built_data(tmp_path_factory):
    """:func:`_write_run`'s data with its caches complete, built once for this module's training
    runs (which only read a complete cache: no test here is about building one)."""
    from levanter_core.data.pipeline import build_caches

    where = tmp_path_factory.mktemp("built-data")
    for _ in build_caches(load_train_config(_write_run(where))[0].data, progress=False):
        pass
    return where


def test_shutdown_at_exit_is_refused_unless_false(tmp_path):
    load_train_config(_write_run(tmp_path, shutdown_at_exit=False))
    with pytest.raises(ConfigError, match="trainer.shutdown_at_exit"):
        load_train_config(_write_run(tmp_path, shutdown_at_exit=True))


def test_require_accelerator_stops_a_cpu_run_before_training(tmp_path):
    config, _ = load_train_config(_write_run(tmp_path, require_accelerator=True))
    with pytest.raises(ConfigError, match="require_accelerator"):
        run_training(config, progress=False)
    assert not os.path.exists(tmp_path / "logs" / "pipe")


# -- end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_batch_size_schedule_z_loss_entropy_and_profiler_in_one_run(tmp_path, built_data):
    schedule = [{"start": 0, "value": 4}, {"start": 2, "value": 8}]
    path = _write_run(
        tmp_path,
        built_data,
        train_batch_size=schedule,
        steps_per_eval=4,
        profiler=True,
        profiler_start_step=1,
        profiler_num_steps=1,
    )
    config, _ = load_train_config(path, ["--z_loss_weight", "0.01", "--log_entropy", "true"])
    result = run_training(config, progress=False)
    logged = [m for m in metrics(tmp_path) if "train/loss" in m]
    assert [m["train/batch_size"] for m in logged] == [4, 4, 8, 8, 8, 8]
    assert all(m["train/z_loss"] > 0 for m in logged)
    final = [m for m in metrics(tmp_path) if "eval/entropy" in m][-1]
    assert 0 < final["eval/entropy"] <= np.log(257) + 1e-3
    assert glob.glob(str(tmp_path / "logs" / "pipe" / "profiler" / "**" / "*.xplane.pb"), recursive=True)
    assert result.final_step == 6


@pytest.mark.slow
def test_fp8_training_trains_and_resumes(tmp_path, built_data):
    path = _write_run(tmp_path, built_data, quantization={"fp8": True}, steps_per_eval=100)
    config, _ = load_train_config(path, ["--trainer.num_train_steps", "3"])
    first = run_training(config, progress=False)
    assert np.isfinite(first.last_loss)
    config, _ = load_train_config(path, ["--trainer.num_train_steps", "5"])
    resumed = run_training(config, progress=False)
    assert resumed.start_step == 3 and resumed.final_step == 5 and np.isfinite(resumed.last_loss)


@pytest.mark.slow
def test_partial_checkpoints_and_initialize_from_checkpoint_path(tmp_path, built_data):
    path = _write_run(tmp_path, built_data, steps_per_eval=100)
    config, _ = load_train_config(path, ["--trainer.num_train_steps", "3"])
    trunk = run_training(config, progress=False)

    # the same run with model averaging: its checkpoint lacks the average
    averaged = ["--trainer.num_train_steps", "4", "--trainer.model_averaging", "{type: ema, beta: 0.9}"]
    config, _ = load_train_config(path, averaged)
    with pytest.raises(CheckpointError, match="model_averaging"):
        run_training(config, progress=False)
    config, _ = load_train_config(path, [*averaged, "--trainer.allow_partial_checkpoint", "true"])
    assert run_training(config, progress=False).start_step == 3

    # a new run branching from the trunk's state continues at its step
    config, _ = load_train_config(
        path,
        [
            "--trainer.id",
            "branch",
            "--trainer.num_train_steps",
            "5",
            "--initialize_from_checkpoint_path",
            trunk.checkpoint,
        ],
    )
    branch = run_training(config, progress=False)
    assert branch.start_step == 3 and branch.final_step == 5
    assert os.path.isdir(tmp_path / "ckpt" / "branch")


@pytest.mark.slow
def test_data_seed_changes_the_data_order_only(tmp_path, built_data):
    path = _write_run(tmp_path, built_data, steps_per_eval=100)

    def first_loss(*args):
        config, _ = load_train_config(path, ["--trainer.num_train_steps", "1", "--data.shuffle", "true", *args])
        return run_training(config, progress=False).first_loss

    same = first_loss("--trainer.id", "a", "--data_seed", "0")
    assert first_loss("--trainer.id", "b") == same  # data_seed unset: trainer.seed (0)
    assert first_loss("--trainer.id", "c", "--data_seed", "7") != same


@pytest.mark.slow
def test_a_run_whose_data_runs_out_ends_early_with_its_checkpoint(tmp_path, built_data):
    path = _write_run(tmp_path, built_data, steps_per_eval=100)
    config, _ = load_train_config(path, ["--trainer.num_train_steps", "500", "--epoch", "1"])
    result = run_training(config, progress=False)
    # one pass over the training sequences, 4 per step; the last batch is whole
    assert 0 < result.final_step < 500 and "pass" in result.ended_early
    assert result.checkpoint.endswith(f"step-{result.final_step}") and result.final_eval_loss is not None
    assert metrics(tmp_path)[-1]["step"] == result.final_step


@pytest.mark.slow
def test_hf_save_exports_during_training_what_export_hf_writes(tmp_path, built_data):
    from safetensors.numpy import load_file

    from levanter_core.hf.bridge import export_hf

    path = _write_run(tmp_path, built_data, steps_per_eval=100)
    args = ["--trainer.num_train_steps", "3", "--hf_save_path", str(tmp_path / "hf"), "--hf_save_steps", "2"]
    config, _ = load_train_config(path, args)
    result = run_training(config, progress=False)
    saved = sorted(os.listdir(tmp_path / "hf" / "pipe"))
    assert saved == ["step-2", "step-3"]
    during = tmp_path / "hf" / "pipe" / "step-3"
    after = export_hf(result.checkpoint, str(tmp_path / "exported"))
    for name in ("config.json", "tokenizer.json"):
        assert (during / name).read_text() == open(os.path.join(after, name)).read()
    mine = load_file(str(next(during.glob("*.safetensors"))))
    theirs = load_file(next(iter(glob.glob(os.path.join(after, "*.safetensors")))))
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(during))
    assert model.config.vocab_size == 257


def test_a_checkpoint_location_out_of_the_checkpointers_reach_stops_before_anything_runs(tmp_path):
    """TensorStore reaches local directories and s3:// and gs:// buckets; fsspec's in-memory
    filesystem is none of them."""
    from levanter_core.run import preflight

    config, _ = load_train_config(_write_run(tmp_path), ["--trainer.checkpointer.base_path", "memory://ckpt"])
    with pytest.raises(ConfigError, match="trainer.checkpointer.base_path: 'memory://ckpt': TensorStore cannot write"):
        preflight(config)
    with pytest.raises(ConfigError, match="trainer.checkpointer.base_path"):
        run_training(config, progress=False)
    assert not os.path.exists(tmp_path / "cache") and not os.path.exists(tmp_path / "logs")


def test_the_run_id_counts_only_what_differs_from_the_defaults(tmp_path):
    from levanter_core.run import derive_run_id

    path = _write_run(tmp_path)

    def run_id(*args):  # without trainer.id: the file's name and a hash of the config
        return derive_run_id(load_train_config(path, ["--trainer.id", "null", *args])[0], path)

    plain = run_id()
    # fields written at their defaults (as a release that adds a field with a default does)
    spelled_out = ["--z_loss_weight", "0.0", "--data.stop_strategy", "restart", "--trainer.profiler", "false"]
    assert run_id(*spelled_out) == plain and plain.startswith("pipe-")
    assert run_id("--z_loss_weight", "0.01") != plain
