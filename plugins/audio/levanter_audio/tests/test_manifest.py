import base64
import io
import json

import numpy as np
import pytest
import soundfile

from levanter_audio.io import load_audio
from levanter_audio.manifest import read_manifest
from levanter_audio.synth import make_speech_corpus
from levanter_core.errors import DataError

SENTENCES = ["Turn left at the lights.", "Then keep going straight for a mile."]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_speech_corpus(tmp_path_factory.mktemp("corpus"), SENTENCES, fmt="flac")


def test_round_trip(corpus):
    utterances = list(read_manifest(corpus))
    assert [u.text for u in utterances] == SENTENCES
    assert [u.where for u in utterances] == [f"{corpus}:1", f"{corpus}:2"]
    for u, name in zip(utterances, ["00000.flac", "00001.flac"]):
        assert u.audio.dtype == np.float32 and len(u.audio) > 8000
        np.testing.assert_array_equal(u.audio, load_audio(corpus.replace("manifest.jsonl", name)))
    assert [u.text for u in read_manifest(corpus, start=1)] == SENTENCES[1:]


def test_relative_paths_are_the_manifests_and_other_keys_work(corpus, tmp_path, monkeypatch):
    manifest = tmp_path / "elsewhere" / "m.jsonl"
    manifest.parent.mkdir()
    clip = corpus.replace("manifest.jsonl", "00000.flac")
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.flac").write_bytes(open(clip, "rb").read())
    rows = [
        {"path": "../clips/a.flac", "sentence": "relative"},
        {"path": {"path": clip}, "sentence": "an Audio object with a path"},
        {"path": {"bytes": base64.b64encode(open(clip, "rb").read()).decode()}, "sentence": "bytes"},
        {"path": {"array": [0.0, 0.5, -0.5, 0.0] * 2000, "sampling_rate": 8000}, "sentence": "array"},
    ]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path / "clips")  # the working directory does not matter
    utterances = list(read_manifest(manifest, text_key="sentence", audio_key="path"))
    assert [u.text for u in utterances] == [r["sentence"] for r in rows]
    for u in utterances[:3]:
        np.testing.assert_array_equal(u.audio, utterances[0].audio)
    assert abs(len(utterances[3].audio) - 16000) <= 1


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"audio": "00000.flac"}, "no 'text' field (the transcript); the record has 'audio'"),
        ({"audio": "00000.flac", "text": "   "}, "empty transcript in 'text'"),
        ({"audio": "00000.flac", "text": 7}, "the transcript 'text' should be a string, found int"),
        ({"text": "hello"}, "no 'audio' field (the audio); the record has 'text'"),
        ({"audio": "nowhere.wav", "text": "hello"}, "nowhere.wav: no such file"),
        ({"audio": "notes.wav", "text": "hello"}, "notes.wav: not an audio file that can be decoded"),
        ({"audio": "cut.wav", "text": "hello"}, "cut.wav: truncated"),
        ({"audio": {"url": "x"}, "text": "hello"}, "the audio object has 'url'; expected 'path', 'bytes'"),
        ("not json", "not valid JSON"),
    ],
)
def test_bad_lines_name_the_manifest_and_line(corpus, tmp_path, line, message):
    directory = tmp_path
    (directory / "00000.flac").write_bytes(open(corpus.replace("manifest.jsonl", "00000.flac"), "rb").read())
    (directory / "notes.wav").write_text("not audio\n" * 50)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(16000, np.float32), 16000, format="WAV")
    (directory / "cut.wav").write_bytes(buffer.getvalue()[:9000])
    good = json.dumps({"audio": "00000.flac", "text": "fine"})
    bad = line if isinstance(line, str) else json.dumps(line)
    manifest = directory / "train.jsonl"
    manifest.write_text(f"{good}\n\n{bad}\n")
    utterances = read_manifest(manifest)
    assert next(utterances).text == "fine"
    with pytest.raises(DataError) as error:
        next(utterances)
    assert str(error.value).startswith(f"{manifest}:3: ")
    assert message in str(error.value)


def test_missing_manifest(tmp_path):
    with pytest.raises(DataError, match="train.jsonl: no such file"):
        list(read_manifest(tmp_path / "train.jsonl"))


def test_manifest_on_an_object_store(corpus):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/speech/clips/0.flac", open(corpus.replace("manifest.jsonl", "00000.flac"), "rb").read())
    fs.pipe("/speech/train.jsonl", b'{"audio": "clips/0.flac", "text": "remote"}\n')
    [utterance] = read_manifest("memory://speech/train.jsonl")
    assert utterance.text == "remote" and len(utterance.audio) > 8000
