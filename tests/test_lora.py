"""LoRA (``lora:``): the surgery on every architecture, what trains, the checkpoints that hold
only the adapters, exports merged and as PEFT adapters that ``peft`` loads onto the Hugging
Face base model with the same logits, and Levanter's LoRA configs."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from levanter_core import lora
from levanter_core.errors import CheckpointError, ConfigError
from levanter_core.testing import logged

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from levanter_core.hf.bridge import load_hf_model, write_hf_model  # noqa: E402
from levanter_core.hf.parity import hf_logits, our_logits, random_hf_model  # noqa: E402
from levanter_core.hf.peft import ADAPTER_CONFIG, write_peft_adapter  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "levanter-configs"

LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
MOE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=64)  # fmt: skip

# One small Hugging Face model of each family the model plugins cover.
FAMILIES = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4),
    "llama": lambda: transformers.LlamaConfig(**LLAMA),
    "phi3": lambda: transformers.Phi3Config(**LLAMA, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma2": lambda: transformers.Gemma2Config(**LLAMA, head_dim=16),
    "qwen3": lambda: transformers.Qwen3Config(**LLAMA, head_dim=16),
    "olmo2": lambda: transformers.Olmo2Config(**LLAMA),
    "mixtral": lambda: transformers.MixtralConfig(**MOE, intermediate_size=32, num_local_experts=4),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**MOE, "num_key_value_heads": 4},
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=1,
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **MOE, intermediate_size=48, head_dim=16, num_local_experts=4, num_experts_per_tok=2
    ),
}
FUSED = {"phi3": "qkv_proj"}
"""Families whose Hugging Face form fuses projections that we keep apart: their adapters have no
PEFT form (the merged export is what they get)."""
PEFT_CANNOT_LOAD = {"deepseek_v3"}
"""Families whose PEFT adapter we write (its tensors equal the merged weights' differences) but
peft 0.21 does not put back on transformers 5's model: on DeepSeek-V3 it wraps the experts and
reports the dense MLP's adapter tensors as unexpected keys."""

TOKENS = np.random.default_rng(3).integers(0, 128, size=(2, 12))


def trained_like(model, key=7):
    """``model`` with its adapters' ``B`` drawn at random, as training would leave it (at the
    start ``B`` is zero and the adapters change nothing)."""
    import haliax as hax

    def fill(node):
        if not isinstance(node, lora.LowRankLinear):
            return node
        b = node.lora_B.weight
        noise = jax.random.normal(jax.random.PRNGKey(key), b.array.shape, b.dtype) * 0.05
        return eqx.tree_at(lambda n: n.lora_B.weight, node, hax.named(b.array + noise, b.axes))

    return jax.tree.map(fill, model, is_leaf=lambda n: isinstance(n, lora.LowRankLinear))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_on_every_family_export_merged_and_as_peft(family, tmp_path):
    base_dir = str(tmp_path / "base")
    random_hf_model(FAMILIES[family]()).save_pretrained(base_dir)
    loaded = load_hf_model(base_dir)
    model = lora.loraize(loaded.model, lora.LoraConfig(r=4, alpha=16), key=jax.random.PRNGKey(1))
    before = our_logits(loaded.model, TOKENS)
    # B starts at zero: the adapted model computes what the base computes
    np.testing.assert_allclose(our_logits(model, TOKENS), before, atol=1e-5)
    model = trained_like(model)
    ours = our_logits(model, TOKENS)
    assert np.abs(ours - before).max() > 1e-3  # the adapters matter
    np.testing.assert_allclose(our_logits(lora.merge(model), TOKENS), ours, atol=1e-4)

    merged_dir = str(tmp_path / "merged")
    write_hf_model(model, loaded.config, loaded.Vocab, merged_dir, run_config={"data": {"tokenizer": "byte"}},
                   imported_hf_config=loaded.hf_config)  # fmt: skip
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(merged, TOKENS), ours, atol=1e-4)

    adapter_dir = str(tmp_path / "adapter")
    if family in FUSED:
        with pytest.raises(CheckpointError, match="fused"):
            write_peft_adapter(model, lora.LoraConfig(r=4, alpha=16), adapter_dir, base_model_name_or_path=base_dir)
        return
    write_peft_adapter(model, lora.LoraConfig(r=4, alpha=16), adapter_dir, base_model_name_or_path=base_dir)
    if family in PEFT_CANNOT_LOAD:
        return
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    np.testing.assert_allclose(hf_logits(adapted, TOKENS), ours, atol=1e-4)


@pytest.mark.slow
def test_adapters_on_whisper_the_encoder_decoder(tmp_path):
    """Speech too: every linear layer of Whisper's encoder and decoder stacks gets adapters, and
    the merged export and the PEFT adapter (a sequence-to-sequence one) give our logits."""
    from levanter_core.hf.peft import task_type_of

    hf_config = transformers.WhisperConfig(
        vocab_size=96, num_mel_bins=8, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_layers=2, decoder_attention_heads=2, decoder_ffn_dim=48, max_source_positions=16,
        max_target_positions=24, pad_token_id=95, bos_token_id=95, eos_token_id=95, decoder_start_token_id=94,
    )  # fmt: skip
    base_dir = str(tmp_path / "base")
    random_hf_model(hf_config, auto_class=transformers.AutoModelForSpeechSeq2Seq).save_pretrained(base_dir)
    loaded = load_hf_model(base_dir)
    layers = lora.target_layers(loaded.model, lora.LoraConfig())
    assert "model.encoder.layers.fc1" in layers and "model.decoder.layers.encoder_attn.q_proj" in layers
    model = trained_like(lora.loraize(loaded.model, lora.LoraConfig(r=4, alpha=8), key=jax.random.PRNGKey(0)))

    import haliax as hax

    rng = np.random.default_rng(0)
    features = rng.standard_normal((2, 8, 32)).astype(np.float32)
    ids = rng.integers(0, 96, size=(2, 10))
    named = (hax.named(jnp.asarray(features), ("batch", "mels", "frames")),
             hax.named(jnp.asarray(ids, dtype=jnp.int32), ("batch", "position")))  # fmt: skip

    def ours_of(m):
        logits = eqx.filter_jit(lambda m, f, t: m(f, t))(m, *named)
        return np.asarray(logits.rearrange(("batch", "position", "vocab")).array)

    def theirs_of(m):
        with torch.no_grad():
            return m(input_features=torch.as_tensor(features), decoder_input_ids=torch.as_tensor(ids)).logits.numpy()

    ours = ours_of(model)
    assert np.abs(ours - ours_of(loaded.model)).max() > 1e-3
    merged_dir, adapter_dir = str(tmp_path / "merged"), str(tmp_path / "adapter")
    write_hf_model(model, loaded.config, loaded.Vocab, merged_dir, run_config={"data": {"tokenizer": "byte"}},
                   imported_hf_config=loaded.hf_config)  # fmt: skip
    np.testing.assert_allclose(
        theirs_of(transformers.AutoModelForSpeechSeq2Seq.from_pretrained(merged_dir)), ours, atol=1e-4
    )
    task = task_type_of(loaded.config, loaded.Vocab.size)
    assert task == "SEQ_2_SEQ_LM"
    write_peft_adapter(
        model, lora.LoraConfig(r=4, alpha=8), adapter_dir, base_model_name_or_path=base_dir, task_type=task
    )
    base = transformers.AutoModelForSpeechSeq2Seq.from_pretrained(base_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    # (PEFT's sequence-to-sequence wrapper passes input_ids, which Whisper's decoder refuses; the
    # wrapped model, adapters in place, is what it runs)
    np.testing.assert_allclose(theirs_of(adapted.get_base_model()), ours, atol=1e-4)


def _tiny_llama(directory: str, **overrides) -> str:
    random_hf_model(transformers.LlamaConfig(**{**LLAMA, **overrides})).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from levanter_core.data.tokenizer import ByteTokenizer

    directory = _tiny_llama(str(tmp_path_factory.mktemp("hf") / "tiny-llama"), vocab_size=300, rms_norm_eps=1e-5)
    Path(directory, "tokenizer.json").write_text(ByteTokenizer().to_tokenizer_json())
    return directory


def test_targets_by_list_regex_and_all_linear(llama_dir):
    model = load_hf_model(llama_dir).model
    every = lora.target_layers(model, lora.LoraConfig())
    assert every == [
        f"model.layers.{p}"
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    assert "lm_head" in lora.linear_layers(model)  # the head is a linear layer, left alone by default
    assert lora.target_layers(model, lora.LoraConfig(target_modules=["q_proj", "v_proj"])) == [
        "model.layers.self_attn.q_proj", "model.layers.self_attn.v_proj"]  # fmt: skip
    assert lora.target_layers(model, lora.LoraConfig(target_modules=r".*mlp\.(up|down)_proj")) == [
        "model.layers.mlp.up_proj", "model.layers.mlp.down_proj"]  # fmt: skip
    with pytest.raises(ConfigError, match="matches none .* q_proj"):
        lora.target_layers(model, lora.LoraConfig(target_modules=["Wqkv"]))
    with pytest.raises(ConfigError, match="output head"):
        lora.target_layers(model, lora.LoraConfig(target_modules=["lm_head"]))


def test_scanned_and_unrolled_layers_get_the_same_adapters(llama_dir):
    from levanter_core.hf.convert import to_hf_state_dict

    config = lora.LoraConfig(r=2, alpha=4, target_modules=["v_proj", "down_proj"])
    scanned = load_hf_model(llama_dir)
    unrolled = load_hf_model(llama_dir, config=scanned.config.model_copy(update={"scan_layers": False}))
    a = trained_like(lora.loraize(scanned.model, config, key=jax.random.PRNGKey(0)))
    b = lora.loraize(unrolled.model, config, key=jax.random.PRNGKey(0))
    assert lora.count_parameters(lora.adapter_params(a)) == lora.count_parameters(lora.adapter_params(b)) == 2 * 2 * (
        (64 + 32) + (96 + 64))  # fmt: skip
    # the scanned stack's adapters, exported, go to the right layer of the unrolled model
    names_a = set(to_hf_state_dict(lora.merge(a)))
    assert names_a == set(to_hf_state_dict(lora.merge(b)))
    tensors, modules, conv1d = __import__("levanter_core.hf.peft", fromlist=["peft_tensors"]).peft_tensors(a)
    assert modules == sorted(modules) and len(modules) == 4 and not conv1d
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (2, 96)
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 2)


def test_only_the_adapters_train_and_hold_optimizer_state(llama_dir):
    import optax

    from levanter_core.objective import LmObjective
    from levanter_core.trainer.config import TrainerConfig
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer, trainable

    loaded = load_hf_model(llama_dir)
    model = lora.loraize(loaded.model, lora.LoraConfig(r=4, alpha=8, dropout=0.1), key=jax.random.PRNGKey(0))
    config = TrainerConfig(train_batch_size=2, num_train_steps=3, mp="p=f32")
    trainer = Trainer(config, optax.adamw(1e-2), LmObjective(), mesh=make_mesh(config))
    state = trainer.state_from_model(model, jax.random.PRNGKey(0))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * lora.count_parameters(trainable(state.model))  # Adam's mu and nu
    adapters = lora.count_parameters(lora.adapter_params(model))
    assert lora.count_parameters(trainable(state.model)) == adapters < lora.count_parameters(model) / 5
    batch = (TOKENS[:, :8] % 257).astype(np.int32)
    base_before = [np.asarray(x) for x in jax.tree.leaves(lora.base_model(state.model))]
    adapters_before = [np.asarray(x) for x in jax.tree.leaves(trainable(state.model))]
    after, _ = trainer.train_step(state, batch)  # (the step takes the state's buffers)
    for x, y in zip(base_before, jax.tree.leaves(lora.base_model(after.model))):
        np.testing.assert_array_equal(x, np.asarray(y))  # frozen, bit for bit
    changed = [
        not np.array_equal(x, np.asarray(y)) for x, y in zip(adapters_before, jax.tree.leaves(trainable(after.model)))
    ]
    assert changed and all(changed)


def test_adapter_dropout_acts_only_with_a_training_key():
    import dataclasses

    import haliax as hax

    linear = __import__("levanter_core.layers", fromlist=["init_linear"]).init_linear(
        hax.Axis("embed", 16), hax.Axis("mlp", 8), key=jax.random.PRNGKey(0), std=0.1)  # fmt: skip
    adapted = trained_like(lora.loraize({"proj": linear}, lora.LoraConfig(r=4, dropout=0.5), key=jax.random.PRNGKey(1)))
    x = hax.random.normal(jax.random.PRNGKey(2), (hax.Axis("position", 6), hax.Axis("embed", 16)))
    plain = adapted["proj"](x)
    keyed = lora.with_dropout_keys(adapted, jax.random.PRNGKey(3))
    assert keyed["proj"].lora.key is not None
    dropped = keyed["proj"](x)
    assert np.abs((dropped - plain).array).max() > 1e-4  # a mask was drawn
    no_dropout = dataclasses.replace(adapted["proj"].lora, dropout=0.0)
    assert lora.with_dropout_keys({"p": no_dropout}, jax.random.PRNGKey(3))["p"].key is None


def _lora_run(tmp_path: Path, hf_dir: str, steps: int, **extra) -> str:
    config = {
        "data": {"type": "python_stdlib", "tokenizer": "byte", "cache_dir": str(tmp_path / "cache"), "max_files": 5},
        "trainer": {"id": "run", "train_batch_size": 4, "num_train_steps": steps, "steps_per_eval": steps,
                    "max_eval_batches": 1, "log_dir": str(tmp_path / "logs"),
                    "checkpointer": {"base_path": str(tmp_path / "ckpt"), "keep": [{"every": 2}]}},
        "optimizer": {"learning_rate": 1e-2, "weight_decay": 0.0, "warmup": 0.0},
        "initialize_from_hf": hf_dir,  # no model section: the architecture is the Hugging Face model's
        "max_train_length": 32,
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        "peft_save_path": str(tmp_path / "peft"),
        "hf_save_steps": 100,
        **extra,
    }  # fmt: skip
    path = tmp_path / "lora.yaml"
    path.write_text(json.dumps(config))
    return str(path)


def _losses(tmp_path: Path) -> dict[int, float]:
    return logged(tmp_path / "logs" / "run")


@pytest.mark.slow
def test_a_lora_run_resumes_bit_for_bit_and_exports_what_it_trained(llama_dir, tmp_path):
    from conftest import run_cli
    from levanter_core.checkpoint import read_metadata
    from levanter_core.cli import main
    from levanter_core.hf.bridge import load_checkpoint_model

    config = _lora_run(tmp_path, llama_dir, steps=6)
    result = run_cli("train", config, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert (
        "LoRA: training 3,072 adapter parameters" in result.stdout
    )  # 2 layers x r 4 x ((64+64) + (64+32) + (96+64)) and "point to the base weights" in result.stdout
    whole = _losses(tmp_path)
    assert len(whole) == 6

    # the checkpoint holds the adapters, their optimizer state and the step; it points to the base
    described = read_metadata(str(tmp_path / "ckpt" / "run" / "step-6"))
    names = [leaf["name"] for leaf in described["leaves"]]
    assert [n for n in names if n.startswith("model/")] and all("/lora/" in n for n in names if n.startswith("model/"))
    assert described["metadata"]["lora_base"] == {"initialize_from_hf": llama_dir}

    # interrupted after step 4 (its checkpoint kept): the same command again gives the same losses
    shutil.rmtree(tmp_path / "ckpt" / "run" / "step-6")
    result = run_cli("train", config, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout and "step-4 at step 4" in result.stdout
    assert _losses(tmp_path) == whole

    # the model in training, the merged export and the PEFT adapter on the base give one answer
    tokens = TOKENS % 257
    ours = our_logits(load_checkpoint_model(str(tmp_path / "ckpt" / "run")).model, tokens)
    # (the command's own entry point, in this process: a subprocess each would add 4 CPU-seconds
    # of imports to what the two runs above already show of a subprocess)
    for export in ([str(tmp_path / "merged")], [str(tmp_path / "adapter"), "--peft"]):
        with pytest.raises(SystemExit) as done:
            main(["export-hf", str(tmp_path / "ckpt" / "run"), *export])
        assert done.value.code == 0, export
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), attn_implementation="eager")
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    np.testing.assert_allclose(hf_logits(merged, tokens), ours, atol=1e-4)
    np.testing.assert_allclose(hf_logits(adapted, tokens), ours, atol=1e-4)
    # sampling and serving load it with the adapters merged: the same logits, plain linear layers
    from levanter_core.models.source import load_model_source

    served = load_model_source(str(tmp_path / "ckpt" / "run")).model
    assert not lora.has_adapters(served)
    np.testing.assert_allclose(our_logits(served, tokens), ours, atol=1e-4)
    untouched = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="eager")
    assert np.abs(hf_logits(untouched, tokens) - ours).max() > 1e-3  # it did train
    adapter_config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert adapter_config["base_model_name_or_path"] == llama_dir and adapter_config["r"] == 4
    # and the run wrote the same adapter itself at its end (peft_save_path)
    assert (tmp_path / "peft" / "run" / "step-6" / "adapter_model.safetensors").exists()


def test_a_lora_config_without_a_base_to_read_names_the_field(tmp_path):
    from levanter_core.config.train import load_train_config

    config = _lora_run(tmp_path, str(tmp_path / "missing"), steps=2)
    with pytest.raises(ConfigError) as raised:
        load_train_config(config)
    message = str(raised.value)
    assert "there is no model section" in message and "initialize_from_hf" in message and "lora.yaml" in message


def test_peft_save_path_without_lora_is_refused(tmp_path, llama_dir):
    from levanter_core.config.train import load_train_config

    config = _lora_run(tmp_path, llama_dir, steps=2)
    with pytest.raises(ConfigError, match="peft_save_path writes LoRA adapters"):
        load_train_config(config, ["--lora", "null"])


needs_reference = pytest.mark.skipif(not REFERENCE.is_dir(), reason=f"Levanter's configs are not at {REFERENCE}")


@needs_reference
def test_levanter_lora_llama2_config_loads_and_runs_on_a_local_base(llama_dir, tmp_path, monkeypatch):
    """``config/lora_llama2.yaml`` as Levanter ships it, with only what cannot be reached here
    replaced: the base model (a hub name) and the data (which it leaves to the user)."""
    from levanter_core.config.train import load_train_config
    from levanter_core.testing import train_briefly

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # trainer.wandb
        config, _ = load_train_config(
            str(REFERENCE / "config/lora_llama2.yaml"),
            ["--initialize_from_hf", llama_dir, "--data.tokenizer", "byte", "--data.type", "python_stdlib"],
        )
    assert config.lora == lora.LoraConfig()  # Levanter's defaults: r 8, alpha 8, every linear layer
    assert config.peft_save_path == "lora_llama2" and config.model.seq_len == 2048 and config.model.type == "llama"
    assert config.trainer.num_train_steps == 5000 and config.optimizer.learning_rate == 3e-4
    assert config.trainer.train_batch_size == -1 and config.trainer.per_device_parallelism == 4  # 4 x devices
    monkeypatch.chdir(tmp_path)  # peft_save_path is relative
    monkeypatch.setenv("WANDB_MODE", "offline")  # its trainer.wandb section
    result = train_briefly(
        str(REFERENCE / "config/lora_llama2.yaml"), str(tmp_path), steps=2,
        overrides=["--initialize_from_hf", llama_dir, "--data.tokenizer", "byte", "--data.type", "python_stdlib",
                   "--max_train_length", "32", "--trainer.mp", "p=f32"],  # its tensor_parallel_axes [mlp, heads] too
    )  # fmt: skip
    assert result.final_step == 2
    import yaml

    saved = yaml.safe_load((tmp_path / "logs" / result.run_id / "config.yaml").read_text())
    assert saved["trainer"]["train_batch_size"] == 4 * jax.device_count()  # -1 worked out for the devices
    assert (tmp_path / "lora_llama2" / result.run_id / "step-2" / ADAPTER_CONFIG).exists()


@needs_reference
def test_levanter_mpt_lora_config_says_what_it_needs():
    """``config/lora/mpt_biomed.yaml`` starts from MosaicML's MPT, which no installed plugin
    provides; offline, its base cannot even be read. The message names the field and the file."""
    from levanter_core.config.train import load_train_config

    with pytest.raises(ConfigError) as raised:
        load_train_config(str(REFERENCE / "config/lora/mpt_biomed.yaml"))
    message = str(raised.value)
    assert "initialize_from_hf" in message and "mpt_biomed.yaml" in message and "mosaicml/mpt-7b" in message


def test_a_lora_run_exports_every_1000_steps_unless_told(tmp_path, llama_dir):
    from levanter_core.config.train import load_train_config

    config = _lora_run(tmp_path, llama_dir, steps=2)
    raw = json.loads(Path(config).read_text())
    del raw["hf_save_steps"]
    Path(config).write_text(json.dumps(raw))
    assert load_train_config(config)[0].hf_save_steps == 1000  # Levanter's lora_lm default
    assert load_train_config(config, ["--lora", "null", "--peft_save_path", "null"])[0].hf_save_steps == 10000


@pytest.mark.slow
def test_peft_save_path_on_a_fused_family_is_refused_before_training(tmp_path):
    from conftest import run_cli
    from levanter_core.data.tokenizer import ByteTokenizer

    base = str(tmp_path / "phi3")
    random_hf_model(transformers.Phi3Config(**{**LLAMA, "vocab_size": 300}, pad_token_id=0, bos_token_id=1,
                                            eos_token_id=2)).save_pretrained(base)  # fmt: skip
    Path(base, "tokenizer.json").write_text(ByteTokenizer().to_tokenizer_json())
    result = run_cli("train", _lora_run(tmp_path, base, steps=4), "--no-progress")
    assert result.returncode == 2, result.stderr
    assert "peft_save_path: these adapters have no PEFT form" in result.stderr + result.stdout
    assert "model.layers.self_attn.q_proj" in result.stderr + result.stdout
    assert not (tmp_path / "ckpt" / "run").exists() or not list((tmp_path / "ckpt" / "run").glob("step-*"))


def test_averaged_adapters_leave_the_base_exact(llama_dir):
    import optax

    from levanter_core.objective import LmObjective
    from levanter_core.trainer.config import TrainerConfig
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer

    loaded = load_hf_model(llama_dir)
    model = lora.loraize(loaded.model, lora.LoraConfig(r=2, alpha=4), key=jax.random.PRNGKey(0))
    config = TrainerConfig(
        train_batch_size=2, num_train_steps=3, mp="p=f32", model_averaging={"type": "ema", "beta": 0.999}
    )
    trainer = Trainer(config, optax.adamw(1e-2), LmObjective(), mesh=make_mesh(config))
    state = trainer.state_from_model(model, jax.random.PRNGKey(0))
    base = [np.asarray(x) for x in jax.tree.leaves(lora.base_model(model))]
    for _ in range(2):
        state, _ = trainer.train_step(state, (TOKENS[:, :8] % 257).astype(np.int32))
    averaged = state.model_averaging.model
    for x, y in zip(base, jax.tree.leaves(lora.base_model(averaged))):
        np.testing.assert_array_equal(x, np.asarray(y))  # an EMA of a constant would drift in the last bits
    assert not np.array_equal(
        np.asarray(jax.tree.leaves(lora.adapter_params(averaged))[1]), np.zeros(1)
    )  # fmt: skip
