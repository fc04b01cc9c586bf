"""Wav2Vec2 CTC tokenizers (``data.tokenizer: facebook/wav2vec2-base-960h``, the tokenizer of
Levanter's Whisper config): no ``tokenizer.json``, only a ``vocab.json`` of characters, rebuilt
as one. The reference is ``transformers``' ``Wav2Vec2CTCTokenizer`` reading the same files; the
files and the Hugging Face cache holding them are written here, nothing is downloaded."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import shutil
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest

from levanter_core.data.tokenizer import (
    HUB_TOKENIZER_FILES,
    check_tokenizer_available,
    find_tokenizer_json,
    load_tokenizer,
)
from levanter_core.data.tokenizer import load as tokenizer_load
from levanter_core.errors import DataError

HUB_NAME = "facebook/wav2vec2-base-960h"

# wav2vec2-base-960h's vocabulary: four special tokens, the word delimiter, then the letters
# of English transcripts by frequency and the apostrophe.
WAV2VEC2_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "|", *"ETAONIHSRDLUMWCFGYPBVK'XJQZ"]

# Uppercase, lowercase, apostrophes, several and leading or trailing spaces, characters outside
# the vocabulary (digits, punctuation, a tab, a newline, an emoji, accents, letters that
# upper-case into two), and special tokens written in the text, with spaces around them.
TEXTS = [
    "HELLO WORLD",
    "hello world",
    "Mixed Case, Too!",
    "DON'T  STOP   BELIEVING",
    " LEADING AND TRAILING ",
    "ROOM 101\tNEXT\nLINE",
    "CAFÉ 😀 straße ﬁne",
    "A <s> B </s>",
    "<unk><pad>X",
    "<S>",
    "A|B",
    "",
]


def write_wav2vec2_tokenizer(directory: Path, *, do_lower_case: bool = False, tokens=WAV2VEC2_TOKENS) -> Path:
    """The tokenizer files of wav2vec2-base-960h (``do_lower_case`` as given) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    config = {
        **specials,
        "do_lower_case": do_lower_case,
        "word_delimiter_token": "|",
        "return_attention_mask": False,
        "do_normalize": True,
        "tokenizer_class": "Wav2Vec2CTCTokenizer",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "special_tokens_map.json").write_text(json.dumps(specials))
    return directory


def put_in_hub_cache(hub_cache: Path, repo_id: str, source: Path) -> Path:
    """Copy the files of ``source`` into the Hugging Face cache at ``hub_cache`` as model
    ``repo_id`` at branch ``main`` (``refs/main`` names the commit whose snapshot holds them)."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path, and the hub offline, for this process and its
    children (huggingface_hub read the environment when it was imported: its constants too)."""
    hub_cache = tmp_path / "hf" / "hub"
    hub_cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("do_lower_case", [False, True])
def test_ids_are_those_of_transformers_wav2vec2_ctc_tokenizer(tmp_path, transformers, do_lower_case):
    directory = write_wav2vec2_tokenizer(tmp_path / "w2v", do_lower_case=do_lower_case)
    reference = transformers.Wav2Vec2CTCTokenizer.from_pretrained(str(directory))
    ours = load_tokenizer(str(directory))
    assert ours.vocab_size == reference.vocab_size == 32
    for text in TEXTS:
        expected = reference(text)["input_ids"]
        assert ours.encode_batch([text])[0].tolist() == expected, text
        ids, _ = ours.encode_with_offsets([text])[0]
        assert ids.tolist() == expected, text
    # What do_lower_case means: lowercase input is accepted, read as uppercase.
    hello = ours.encode_batch(["hello world"])[0].tolist()
    assert hello == ([11, 5, 15, 15, 8, 4, 18, 8, 13, 15, 14] if do_lower_case else [3, 3, 3, 3, 3, 4, 3, 3, 3, 3, 3])


def test_a_vocabulary_without_the_default_special_tokens_matches_transformers(tmp_path, transformers):
    """Many fine-tuned wav2vec2 models: ``[PAD]`` and ``[UNK]``, lowercase letters, and no
    ``<s>``/``</s>``, which both tokenizers add after the vocabulary, in the same order."""
    directory = tmp_path / "fine-tuned"
    tokens = ["[PAD]", "[UNK]", "|", *"etaoinshrdlucmfwypvbgkqjxz'"]
    write_wav2vec2_tokenizer(directory, tokens=tokens)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config |= {"unk_token": "[UNK]", "pad_token": "[PAD]"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "special_tokens_map.json").unlink()

    reference = transformers.Wav2Vec2CTCTokenizer.from_pretrained(str(directory))
    ours = load_tokenizer(str(directory))
    assert ours.vocab_size == len(reference) == len(tokens) + 2
    for text in [*TEXTS, "a [PAD] b", "x <s>  y"]:
        assert ours.encode_batch([text])[0].tolist() == reference(text)["input_ids"], text
    assert (ours.eos_id, ours.bos_id) == (len(tokens) + 1, len(tokens))


def test_decoding_gives_the_text_back_with_spaces_for_word_delimiters(tmp_path):
    ours = load_tokenizer(str(write_wav2vec2_tokenizer(tmp_path / "w2v")))
    for text in ["HELLO WORLD", "DON'T  STOP", " A  B ", "<s>THE CAT SAT</s>", "ZZZ QUIZ JAX"]:
        assert ours.decode(ours.encode_batch([text])[0]) == text
    assert ours.decode([11, 5, 15, 15, 8, 4, 18, 8, 13, 15, 14]) == "HELLO WORLD"  # repeats kept: not CTC
    assert ours.decode(ours.encode_batch(["HELLO, WORLD"])[0]) == "HELLO<unk> WORLD"
    lower = load_tokenizer(str(write_wav2vec2_tokenizer(tmp_path / "lower", do_lower_case=True)))
    assert lower.decode(lower.encode_batch(["hello world"])[0]) == "HELLO WORLD"


def test_offsets_are_one_character_a_token(tmp_path):
    ours = load_tokenizer(str(write_wav2vec2_tokenizer(tmp_path / "w2v", do_lower_case=True)))
    text = "it's A <s> ße"
    ids, spans = ours.encode_with_offsets([text])[0]
    pieces = [text[start:end] for start, end in spans.tolist()]
    # A special token's span takes the spaces it swallows; ß is two S, both spanning it.
    assert pieces == ["i", "t", "'", "s", " ", "A", " <s> ", "ß", "ß", "e"]
    assert ids.tolist() == [10, 6, 27, 12, 4, 7, 1, 12, 12, 5]


def test_end_and_beginning_of_text_come_from_the_config_and_none_is_added(tmp_path):
    ours = load_tokenizer(str(write_wav2vec2_tokenizer(tmp_path / "w2v")))
    assert (ours.eos_id, ours.eos_token, ours.bos_id, ours.bos_token) == (2, "</s>", 1, "<s>")
    assert ours.encode_batch(["A"])[0].tolist() == [7]  # no BOS, no EOS around a text
    assert ours.encode_with_offsets(["A"], add_special_tokens=True)[0][0].tolist() == [7]
    # special_tokens_map.json wins over tokenizer_config.json, as in transformers
    (tmp_path / "w2v" / "special_tokens_map.json").write_text(json.dumps({"eos_token": "|", "bos_token": "<pad>"}))
    renamed = load_tokenizer(str(tmp_path / "w2v"))
    assert (renamed.eos_id, renamed.bos_id) == (4, 0)
    assert renamed.fingerprint != ours.fingerprint


def test_the_fingerprint_is_stable_and_follows_do_lower_case(tmp_path):
    plain = write_wav2vec2_tokenizer(tmp_path / "plain")
    assert load_tokenizer(str(plain)).fingerprint == load_tokenizer(str(plain)).fingerprint
    lower = write_wav2vec2_tokenizer(tmp_path / "lower", do_lower_case=True)
    assert load_tokenizer(str(lower)).fingerprint != load_tokenizer(str(plain)).fingerprint


def test_the_exported_tokenizer_json_encodes_as_transformers_does(tmp_path, transformers):
    directory = write_wav2vec2_tokenizer(tmp_path / "w2v", do_lower_case=True)
    exported = tmp_path / "tokenizer.json"
    exported.write_text(load_tokenizer(str(directory)).to_tokenizer_json())
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(exported))
    reference = transformers.Wav2Vec2CTCTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        assert fast(text)["input_ids"] == reference(text)["input_ids"], text
    assert load_tokenizer(str(exported)).encode_batch(["it's"])[0].tolist() == [10, 6, 27, 12]


def test_the_hub_name_resolves_offline_from_the_hugging_face_cache(tmp_path, offline_hub):
    local = write_wav2vec2_tokenizer(tmp_path / "w2v")
    (local / "config.json").write_text(json.dumps({"model_type": "wav2vec2"}))
    snapshot = put_in_hub_cache(offline_hub, HUB_NAME, local)
    # The layout is huggingface_hub's own: its cache lookup finds the files.
    assert huggingface_hub.try_to_load_from_cache(HUB_NAME, "vocab.json") == str(snapshot / "vocab.json")

    check_tokenizer_available(HUB_NAME)
    from_hub, from_dir = load_tokenizer(HUB_NAME), load_tokenizer(str(local))
    assert from_hub.name == HUB_NAME
    assert (from_hub.vocab_size, from_hub.eos_id, from_hub.bos_id) == (32, 2, 1)
    assert from_hub.fingerprint == from_dir.fingerprint
    assert from_hub.encode_batch(["HELLO WORLD"])[0].tolist() == [11, 5, 15, 15, 8, 4, 18, 8, 13, 15, 14]
    # It has no tokenizer.json to hand to those who want one (an export writes it rebuilt).
    with pytest.raises(DataError, match="is a Wav2Vec2CTCTokenizer .*no tokenizer.json"):
        find_tokenizer_json(HUB_NAME)


def test_fetching_from_the_hub_takes_the_tokenizer_files_and_not_the_model(tmp_path, offline_hub, monkeypatch):
    """What ``snapshot_download`` is asked for (its ``allow_patterns``) is enough for this
    tokenizer and leaves the weights behind. The hub is played by a function that copies the
    allowed files of a model directory into a snapshot."""
    hub = write_wav2vec2_tokenizer(tmp_path / "hub")
    for name in ("config.json", "preprocessor_config.json", "pytorch_model.bin", "model.safetensors"):
        (hub / name).write_text("{}")
    asked = []

    def snapshot_download(repo_id, allow_patterns, **kwargs):
        asked.append(repo_id)
        snapshot = tmp_path / "snapshot"
        snapshot.mkdir(exist_ok=True)
        for path in hub.iterdir():
            if any(fnmatch.fnmatch(path.name, pattern) for pattern in allow_patterns):
                shutil.copy(path, snapshot / path.name)
        return str(snapshot)

    monkeypatch.setattr(tokenizer_load, "snapshot_download", snapshot_download)
    assert load_tokenizer(HUB_NAME).vocab_size == 32
    assert asked == [HUB_NAME]
    assert sorted(p.name for p in (tmp_path / "snapshot").iterdir()) == [
        "special_tokens_map.json",
        "tokenizer_config.json",
        "vocab.json",
    ]
    assert HUB_TOKENIZER_FILES[:2] == ("tokenizer.json", "tokenizer_config.json")  # what messages name


def test_offline_without_a_cached_copy_says_what_to_do(offline_hub):
    with pytest.raises(DataError) as error:
        check_tokenizer_available(HUB_NAME)
    message = str(error.value)
    assert "HF_HUB_OFFLINE is set" in message
    assert f"hf download {HUB_NAME} tokenizer.json tokenizer_config.json" in message
    # this model has no tokenizer.json: the message also says what to fetch for it
    assert f"hf download {HUB_NAME} vocab.json tokenizer_config.json special_tokens_map.json" in message


def test_a_broken_vocab_json_names_the_file_and_line(tmp_path):
    directory = write_wav2vec2_tokenizer(tmp_path / "w2v")
    (directory / "vocab.json").write_text('{\n  "<pad>": 0,\n  "<s>": 1\n  "</s>": 2\n}\n')
    with pytest.raises(DataError, match=r"vocab\.json:4: not valid JSON \(Expecting ',' delimiter"):
        load_tokenizer(str(directory))
    (directory / "vocab.json").write_text(json.dumps({"<pad>": 0, "<unk>": "three"}))
    with pytest.raises(DataError, match=r"vocab\.json: expected token -> id .*found '<unk>': 'three'"):
        load_tokenizer(str(directory))
    (directory / "vocab.json").write_text(json.dumps({"<pad>": 0, "A": 1}))
    with pytest.raises(DataError, match=r"vocab\.json: has no entry for the unknown token '<unk>'"):
        load_tokenizer(str(directory))


def test_other_slow_only_tokenizers_keep_the_clear_error(tmp_path, offline_hub):
    """A GPT-2 style ``vocab.json`` and ``merges.txt`` is not read as characters: still an error
    that says what to do."""
    slow = tmp_path / "gpt2-slow"
    slow.mkdir()
    (slow / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (slow / "merges.txt").write_text("#version: 0.2\na b\n")
    (slow / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    with pytest.raises(DataError, match="the directory .*gpt2-slow' has no tokenizer.json"):
        check_tokenizer_available(str(slow))
    put_in_hub_cache(offline_hub, "some-org/slow-gpt2", slow)
    with pytest.raises(DataError, match=r"hub model 'some-org/slow-gpt2' has no tokenizer.json .*convert it"):
        load_tokenizer("some-org/slow-gpt2")
