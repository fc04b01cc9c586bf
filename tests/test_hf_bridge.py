"""The Hugging Face bridge: `levanter import-hf` / `export-hf`, `initialize_from_hf`, and
the one-message errors for checkpoints that do not fit the model.

Uses the Llama plugin (installed with the project) and tiny random ``transformers`` models.
"""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import run_cli

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from haliax import Axis  # noqa: E402

from levanter_core.errors import CheckpointError  # noqa: E402
from levanter_core.hf import load_hf_weights  # noqa: E402
from levanter_core.hf.checkpoint import INDEX_FILE, HfCheckpoint  # noqa: E402
from levanter_core.hf.parity import hf_logits, random_hf_model  # noqa: E402

VOCAB = 300  # room for the byte tokenizer's 257 ids


def tiny_llama_config(**overrides):
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,  # our default, so a `model:` section with only the sizes fits
    )
    return transformers.LlamaConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A saved tiny random Llama, sharded into several safetensors files, with a tokenizer."""
    from levanter_core.data.tokenizer import ByteTokenizer

    directory = str(tmp_path_factory.mktemp("hf") / "tiny-llama")
    random_hf_model(tiny_llama_config()).save_pretrained(directory, max_shard_size="20KB")
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        f.write(ByteTokenizer().to_tokenizer_json())
    return directory


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory):
    """``hf_dir`` imported as our checkpoint, once for this module, in this process (the CLI's
    import is shown by :func:`test_import_then_export_reproduces_the_model`); read, never changed."""
    from levanter_core.hf.bridge import import_hf

    return import_hf(hf_dir, str(tmp_path_factory.mktemp("imported") / "tiny-llama"))


def export(checkpoint, output) -> str:
    """``checkpoint`` (a run's checkpoint directory or an import) exported in this process; the
    CLI's export is shown by :func:`test_import_then_export_reproduces_the_model`."""
    from levanter_core.hf.bridge import export_hf

    return export_hf(str(checkpoint), str(output))


def damaged_copy(hf_dir, tmp_path, edit):
    """A copy of ``hf_dir`` whose tensors ``edit(dict)`` changes, saved as one file."""
    target = tmp_path / "damaged"
    target.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), target)
    tensors = {}
    for file in sorted(os.listdir(hf_dir)):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(hf_dir, file)))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return str(target)


def llama(**fields):
    from levanter_model_llama.llama import LlamaConfig

    base = dict(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    return LlamaConfig(**{**base, **fields})


def load(config, directory):
    return load_hf_weights(config, Axis("vocab", VOCAB), HfCheckpoint(directory))


# -- import and export through the CLI ---------------------------------------------------------


def test_import_then_export_reproduces_the_model(hf_dir, tmp_path):
    imported, exported = str(tmp_path / "imported"), str(tmp_path / "exported")
    result = run_cli("import-hf", hf_dir, imported)
    assert result.returncode == 0, result.stderr
    assert os.path.isfile(os.path.join(imported, "hf_tokenizer", "tokenizer.json"))

    result = run_cli("export-hf", imported, exported, "--max-shard-size", "30KB")
    assert result.returncode == 0, result.stderr
    shards = sorted(f for f in os.listdir(exported) if f.endswith(".safetensors"))
    assert len(shards) > 1
    with open(os.path.join(exported, INDEX_FILE)) as f:
        assert set(json.load(f)["weight_map"].values()) == set(shards)
    assert os.path.isfile(os.path.join(exported, "tokenizer.json"))

    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 16))
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(original, tokens), atol=1e-5)


def test_export_in_bfloat16(imported, tmp_path):
    from levanter_core.hf.bridge import export_hf

    exported = export_hf(imported, str(tmp_path / "exported"), dtype="bfloat16")
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert model.dtype == torch.bfloat16
    assert HfCheckpoint(exported).tensors["model.norm.weight"].dtype == "bfloat16"


def test_import_refuses_to_overwrite_a_checkpoint(hf_dir, imported, tmp_path):
    target = str(tmp_path / "imported")
    shutil.copytree(imported, target)  # a checkpoint that import-hf wrote
    before = sorted(os.listdir(target))
    result = run_cli("import-hf", hf_dir, target)
    assert result.returncode == 2
    assert "already holds a checkpoint" in result.stderr
    assert sorted(os.listdir(target)) == before


def test_unknown_source_is_a_clear_error(tmp_path):
    result = run_cli("import-hf", "no-such-org/no-such-model", str(tmp_path / "out"), env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert "no-such-org/no-such-model" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_architecture_no_plugin_handles(hf_dir, tmp_path):
    directory = tmp_path / "odd"
    shutil.copytree(hf_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "bloom", "architectures": ["Bloom"]}))
    result = run_cli("import-hf", str(directory), str(tmp_path / "out"))
    assert result.returncode == 2
    assert "model_type 'bloom'" in result.stderr and "llama (levanter-model-llama" in result.stderr


# -- mismatches: one message listing every offending tensor -------------------------------------


def test_shape_mismatch_lists_every_tensor_with_both_shapes(hf_dir):
    with pytest.raises(CheckpointError) as e:
        load(llama(intermediate_dim=48), hf_dir)
    message = str(e.value)
    assert "6 tensor(s) differ" in message  # gate, up and down projections of both layers
    assert "model.layers.0.mlp.gate_proj.weight: expected float32[48, 32], found float32[64, 32]" in message
    assert "model.layers.1.mlp.down_proj.weight: expected float32[32, 48], found float32[32, 64]" in message
    assert "Nothing was loaded" in message


def test_missing_and_unexpected_tensors(hf_dir, tmp_path):
    def edit(tensors):
        del tensors["model.layers.1.self_attn.k_proj.weight"]
        tensors["model.layers.1.self_attn.rotary.weight"] = np.zeros(3, np.float32)

    with pytest.raises(CheckpointError) as e:
        load(llama(), damaged_copy(hf_dir, tmp_path, edit))
    message = str(e.value)
    assert "model.layers.1.self_attn.k_proj.weight: expected float32[16, 32], missing from the checkpoint" in message
    assert "model.layers.1.self_attn.rotary.weight: found float32[3], which the model does not have" in message


def test_integer_tensor_where_a_weight_belongs(hf_dir, tmp_path):
    def edit(tensors):
        tensors["model.norm.weight"] = np.ones(32, np.int32)

    with pytest.raises(CheckpointError, match=r"model.norm.weight: expected float32\[32\], found int32\[32\]"):
        load(llama(), damaged_copy(hf_dir, tmp_path, edit))


def test_truncated_shard_names_its_tensors(hf_dir, tmp_path):
    directory = tmp_path / "truncated"
    shutil.copytree(hf_dir, directory)
    with open(directory / INDEX_FILE) as f:
        weight_map = json.load(f)["weight_map"]
    shard = weight_map["model.layers.1.mlp.up_proj.weight"]
    in_shard = sorted(name for name, file in weight_map.items() if file == shard)
    path = directory / shard
    header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    os.truncate(path, header_end + 4)  # the header survives, every tensor's data is cut
    with pytest.raises(CheckpointError) as e:
        load(llama(), str(directory))
    message = str(e.value)
    assert f"{len(in_shard)} tensor(s) differ" in message
    for name in in_shard:
        assert f"{name}: expected float32[" in message
    assert f"shard {shard} is truncated: it has {header_end + 4} bytes" in message


def test_bfloat16_checkpoint_loads_into_a_float32_model(hf_dir, tmp_path):
    import ml_dtypes

    directory = damaged_copy(
        hf_dir, tmp_path, lambda t: t.update({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()})
    )
    model = load(llama(), directory)
    assert model.model.norm.weight.dtype == np.float32


# -- training from Hugging Face weights ---------------------------------------------------------


def _train_config(tmp_path, **extra):
    config = {
        "data": {"type": "python_stdlib", "tokenizer": "byte", "cache_dir": str(tmp_path / "cache"), "max_files": 5},
        "model": {"type": "llama", "seq_len": 32, "hidden_dim": 32, "intermediate_dim": 64, "num_layers": 2,
                  "num_heads": 4, "num_kv_heads": 2},
        "trainer": {"id": "run", "train_batch_size": 2, "num_train_steps": 1, "steps_per_eval": 1, "max_eval_batches": 1,
                    "log_dir": str(tmp_path / "logs"), "checkpointer": {"base_path": str(tmp_path / "ckpt")}},
        "optimizer": {"learning_rate": 0.0, "weight_decay": 0.0, "warmup": 0.0},
        **extra,
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    return str(path)


def train(capsys, config, *args) -> str:
    """``levanter train CONFIG ARGS`` for a run that succeeds, in this process (the CLI's refusals,
    below, run as a user meets them); returns what the run printed."""
    from levanter_core.config.train import load_train_config
    from levanter_core.run import run_training

    capsys.readouterr()
    run_training(load_train_config(config, list(args))[0], config_path=config, progress=False)
    return capsys.readouterr().out


def test_initialize_from_hf_then_export_gives_the_weights_back(hf_dir, tmp_path, capsys):
    # A learning rate of 0: the one training step leaves the imported weights as they were.
    config = _train_config(tmp_path, initialize_from_hf=hf_dir, use_hf_model_config=True)
    assert "initialized from Hugging Face model" in train(capsys, config)

    exported = export(tmp_path / "ckpt" / "run", tmp_path / "exported")
    tokens = np.random.default_rng(1).integers(0, 257, size=(1, 16))
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(original, tokens), atol=1e-5)
    # the run's byte tokenizer went with it, usable by transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer("hé").input_ids == list("hé".encode())


def test_initialize_from_hf_with_a_model_that_does_not_fit(hf_dir, tmp_path):
    config = _train_config(tmp_path, initialize_from_hf=hf_dir)
    result = run_cli("train", config, "--no-progress", "--model.num_kv_heads", "4")
    assert result.returncode == 2
    assert "model.layers.0.self_attn.k_proj.weight: expected float32[32, 32], found float32[16, 32]" in result.stderr
    assert not [d for _, dirs, _ in os.walk(tmp_path / "ckpt") for d in dirs if d.startswith("step-")]


def test_initialize_from_an_imported_checkpoint(hf_dir, imported, tmp_path, capsys):
    train(capsys, _train_config(tmp_path), "--trainer.initialize_from", imported)
    exported = export(tmp_path / "ckpt" / "run", tmp_path / "exported")
    tokens = np.random.default_rng(2).integers(0, 257, size=(1, 8))
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(original, tokens), atol=1e-5)


def test_exporting_a_model_without_a_hugging_face_mapping(fresh_plugins, tmp_path):
    import jax
    from levanter_model_llama.llama import LlamaConfig

    from levanter_core.checkpoint import write_checkpoint
    from levanter_core.hf.bridge import export_hf
    from levanter_core.models.lm import LmConfig
    from levanter_core.plugins import hookimpl, register_plugin

    class NoHfConfig(LmConfig):
        """A model type whose plugin has no Hugging Face translation."""

        type: str = "no-hf"

        @property
        def Embed(self):
            return Axis("embed", 32)

        def build(self, Vocab, *, key):
            return llama().build(Vocab, key=key)

    class Plugin:
        @hookimpl
        def register_models(self, register):
            register("no-hf", NoHfConfig)
            register("llama", LlamaConfig)

    register_plugin(Plugin(), name="no-hf-plugin")
    model = NoHfConfig().build(Axis("vocab", VOCAB), key=jax.random.PRNGKey(0))
    metadata = {"config": {"model": {"type": "no-hf"}}, "vocab_size": VOCAB}
    checkpoint = write_checkpoint({"model": model}, str(tmp_path / "ckpt"), step=0, metadata=metadata)
    with pytest.raises(CheckpointError, match="'no-hf' has no Hugging Face equivalent"):
        export_hf(checkpoint, str(tmp_path / "exported"))


# -- a tokenizer that does not fit the checkpoint ------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    """A tiny random Llama with a 200-token vocabulary: too small for the byte tokenizer's 257."""
    directory = str(tmp_path_factory.mktemp("hf") / "small-vocab")
    random_hf_model(tiny_llama_config(vocab_size=200)).save_pretrained(directory)
    return directory


def _no_checkpoints(tmp_path) -> bool:
    return not [d for _, dirs, _ in os.walk(tmp_path / "ckpt") for d in dirs if d.startswith("step-")]


def test_initialize_from_hf_refuses_a_tokenizer_larger_than_the_embeddings(small_vocab_dir, tmp_path):
    result = run_cli("train", _train_config(tmp_path, initialize_from_hf=small_vocab_dir), "--no-progress")
    assert result.returncode == 2, result.stderr
    message = result.stderr
    assert "initialize_from_hf" in message and "data.tokenizer (byte) has 257 tokens" in message
    assert "embeddings for 200" in message and "resize_vocab_to_match_tokenizer: true" in message
    assert "Traceback" not in message
    assert _no_checkpoints(tmp_path)


def test_initialize_from_hf_refuses_another_tokenizer(hf_dir, tmp_path):
    """The checkpoint's vocabulary (300) has room for the byte tokenizer's 257 ids, but the
    tokenizer it ships gives those ids to other tokens."""
    from levanter_core.testing import train_bpe_tokenizer

    directory = tmp_path / "other-tokenizer"
    shutil.copytree(hf_dir, directory)
    train_bpe_tokenizer(["print('hello world')\n"] * 10, str(directory / "tokenizer.json"), vocab_size=280)
    result = run_cli("train", _train_config(tmp_path, initialize_from_hf=str(directory)), "--no-progress")
    assert result.returncode == 2, result.stderr
    message = result.stderr
    assert "data.tokenizer (byte, 257 tokens) is not the tokenizer of the checkpoint" in message
    assert "id 0 is" in message and "resize_vocab_to_match_tokenizer" in message
    assert "Traceback" not in message
    assert _no_checkpoints(tmp_path)


@pytest.mark.slow
def test_resize_vocab_to_match_tokenizer(small_vocab_dir, tmp_path, capsys):
    # A learning rate of 0: the exported rows are the checkpoint's rows, and the new ones
    config = _train_config(
        tmp_path, initialize_from_hf=small_vocab_dir, use_hf_model_config=True, resize_vocab_to_match_tokenizer=True
    )
    assert "resized its vocabulary from 200 to the tokenizer's 257" in train(capsys, config)

    exported = export(tmp_path / "ckpt" / "run", tmp_path / "exported")
    original = transformers.AutoModelForCausalLM.from_pretrained(small_vocab_dir).state_dict()
    resized = transformers.AutoModelForCausalLM.from_pretrained(exported).state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert tuple(resized[name].shape) == (257, 32)
        np.testing.assert_array_equal(resized[name][:200].numpy(), original[name].numpy())
        new_rows = resized[name][200:].numpy()
        # drawn like the existing rows, not zeros or copies
        assert np.all(np.isfinite(new_rows)) and new_rows.std() > 0.5 * original[name].numpy().std()
