"""Levanter's Whisper config (``config/whisper_tiny_librispeech.yaml`` of the reference set, for
Levanter's ``train_asr``) loads whole and unchanged: its model section, its mixture of one
Hugging Face dataset, its W&B tracker, and its tokenizer ``facebook/wav2vec2-base-960h`` (a
Wav2Vec2 CTC tokenizer of 32 characters) found in a Hugging Face cache written here. Nothing is
downloaded and no dataset is read."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import pytest

LEVANTER_CONFIGS = Path(__file__).resolve().parents[5] / "shared" / "levanter-configs"
LIBRISPEECH = LEVANTER_CONFIGS / "config" / "whisper_tiny_librispeech.yaml"

needs_reference = pytest.mark.skipif(
    not LEVANTER_CONFIGS.is_dir(), reason=f"Levanter's configs are not at {LEVANTER_CONFIGS}"
)

TOKENIZER = "facebook/wav2vec2-base-960h"

# The tokenizer files of wav2vec2-base-960h: its vocabulary (special tokens, the word
# delimiter, the letters by frequency and the apostrophe), its config and special tokens.
WAV2VEC2_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "|", *"ETAONIHSRDLUMWCFGYPBVK'XJQZ"]
WAV2VEC2_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
WAV2VEC2_FILES = {
    "vocab.json": json.dumps({t: i for i, t in enumerate(WAV2VEC2_TOKENS)}),
    "tokenizer_config.json": json.dumps(
        {
            **WAV2VEC2_SPECIALS,
            "do_lower_case": False,
            "word_delimiter_token": "|",
            "tokenizer_class": "Wav2Vec2CTCTokenizer",
        }
    ),
    "special_tokens_map.json": json.dumps(WAV2VEC2_SPECIALS),
}


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A Hugging Face cache in tmp_path holding wav2vec2-base-960h's tokenizer files at branch
    ``main``, laid out as huggingface_hub lays it out, and the hub offline (huggingface_hub read
    the environment when it was imported: its constants are set too)."""
    import huggingface_hub.constants

    hub_cache = tmp_path / "hf" / "hub"
    repo = hub_cache / f"models--{TOKENIZER.replace('/', '--')}"
    commit = hashlib.sha1(TOKENIZER.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in WAV2VEC2_FILES.items():
        (snapshot / name).write_text(text)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshot


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to reach another machine, or to open a Hugging Face dataset, fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"loading the config reached out: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    datasets = pytest.importorskip("datasets")
    for name in ("load_dataset", "load_dataset_builder", "get_dataset_split_names", "get_dataset_config_names"):
        monkeypatch.setattr(datasets, name, refuse)


def load_librispeech():
    from levanter_core.config.train import load_train_config

    return load_train_config(str(LIBRISPEECH))[0]


@needs_reference
def test_levanter_whisper_configs_model_sections_load():
    import yaml

    from levanter_core.config.base import validate_section

    found = sorted(LEVANTER_CONFIGS.rglob("*whisper*.yaml"))
    assert found
    for path in found:
        section = yaml.safe_load(path.read_text())["model"]
        config = validate_section("model", section)
        assert config.type == "whisper"
        # what the file leaves out is whisper-tiny's
        assert (config.d_model, config.encoder_layers, config.num_mel_bins, config.seq_len) == (384, 4, 80, 448)
    librispeech = yaml.safe_load(LIBRISPEECH.read_text())
    assert validate_section("model", librispeech["model"]).vocab_size == 32  # the wav2vec2 tokenizer's


@needs_reference
def test_the_whole_librispeech_config_loads_without_the_network(offline_hub, no_network):
    config = load_librispeech()
    data = config.data
    assert data.tokenizer == TOKENIZER
    assert data.cache_dir == "gs://diva-flash/processed/mixture"
    # a mixture of one Hugging Face dataset, all of the weight on it
    assert list(data.configs) == ["librispeech"] and data.train_weights == {"librispeech": 1.0}
    source = data.configs["librispeech"]
    assert (source.type, source.id, source.name) == ("hf", "WillHeld/librispeech_parquet", None)
    assert (source.train_split, source.validation_split) == ("train.360", "validation")
    assert source.cache_dir == "gs://diva-flash/processed/librispeech"
    assert source.format.type == "audio"  # Levanter reads whisper configs as speech (train_asr)

    assert (config.model.type, config.model.vocab_size, config.model.d_model) == ("whisper", 32, 384)
    trainer = config.trainer
    assert [t.type for t in trainer.tracker] == ["wandb"]
    assert (trainer.tracker[0].project, trainer.tracker[0].tags) == ("levanter", ["librispeech", "whisper"])
    assert (trainer.train_batch_size, trainer.num_train_steps, trainer.per_device_parallelism) == (128, 16000, -1)
    assert str(trainer.mp) == "p=f32,c=bf16" and trainer.model_axis_size == 1
    optimizer = config.optimizer
    assert (optimizer.learning_rate, optimizer.weight_decay, optimizer.warmup) == (3e-3, 0.1, 0.01)
    assert config.hf_save_steps == 16000


@needs_reference
def test_its_tokenizer_comes_from_the_hugging_face_cache_and_fits_the_model(offline_hub, no_network):
    from levanter_core.data.tokenizer import check_tokenizer_available, load_tokenizer
    from levanter_core.run import preflight

    config = load_librispeech()
    check_tokenizer_available(config.data.tokenizer)
    preflight(config)  # what `levanter train` checks before it starts: the tokenizer can be had
    tokenizer = load_tokenizer(config.data.tokenizer)
    assert tokenizer.vocab_size == config.model.vocab_size == 32
    assert (tokenizer.eos_id, tokenizer.bos_id, tokenizer.eos_token) == (2, 1, "</s>")
    ids = tokenizer.encode_batch(["HE SAID IT'S FINE"])[0]
    assert ids.tolist() == [11, 5, 4, 12, 7, 10, 14, 4, 10, 6, 27, 12, 4, 20, 10, 9, 5]
    assert tokenizer.decode(ids) == "HE SAID IT'S FINE"


@needs_reference
def test_without_the_tokenizer_in_the_cache_the_run_stops_saying_what_to_fetch(tmp_path, monkeypatch, no_network):
    import huggingface_hub.constants

    from levanter_core.errors import DataError
    from levanter_core.run import preflight

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as error:
        preflight(load_librispeech())
    assert f"hf download {TOKENIZER} vocab.json tokenizer_config.json special_tokens_map.json" in str(error.value)


@needs_reference
def test_a_current_schema_train_asr_config_loads_with_its_mesh(tmp_path, offline_hub, no_network):
    """Levanter's ``train_asr`` today reads the same audio data section as the release (a
    ``configs:`` mixture with ``train_weights``; its audio data never moved to ``components``),
    and the trainer's mesh is now written as ``trainer.mesh``; the decoder's length stays
    ``model.max_length``. Such a config loads, and its mesh means what Levanter's does."""
    import yaml

    from levanter_core.config.train import load_train_config

    raw = yaml.safe_load(LIBRISPEECH.read_text())
    raw["trainer"].pop("model_axis_size", None)
    raw["trainer"]["mesh"] = {"axes": {"model": 2}, "param_mapping": {"embed": "data"}}
    raw["model"]["max_length"] = 224
    path = tmp_path / "whisper_current.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_train_config(str(path))[0]
    assert config.model.type == "whisper" and config.model.seq_len == 224
    assert list(config.data.configs) == ["librispeech"] and config.data.configs["librispeech"].format.type == "audio"
    mesh = config.trainer.resolved_mesh
    assert mesh.resolved_sizes(8) == {
        "replica_dcn": 1,
        "replica": 1,
        "data": 4,
        "stage": 1,
        "expert": 1,
        "context": 1,
        "model": 2,
    }
    assert config.trainer.parameter_axis_mapping()["embed"] == "data"
    assert config.trainer.compute_axis_mapping()["mlp"] == "model"
