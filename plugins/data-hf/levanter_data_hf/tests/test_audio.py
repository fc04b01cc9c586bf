"""Datasets with a ``datasets.Audio`` column, read through the ``hf`` source without
``torchcodec``: every audio value reaches the record undecoded, as ``{"bytes", "path"}``,
and levanter-audio decodes it to the samples of the file it came from."""

import os
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
from datasets import Audio, Features, List, Value

pytest.importorskip("levanter_audio", reason="the audio plugin decodes what the source reads")
import soundfile
from levanter_audio.io import load_audio
from levanter_audio.manifest import parse_record
from levanter_audio.synth import synthesize

from levanter_core.errors import DataError
from levanter_data_hf import HfSourceConfig

TRANSCRIPTS = ["the cat sat on the mat", "a low hum", "static on the line", "read from its path"]


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[str]:
    """Four short files, one per transcript: speech as 16 kHz WAV, a sine as 8 kHz FLAC,
    stereo noise as 44.1 kHz WAV, and speech as 22.05 kHz FLAC."""
    directory = tmp_path_factory.mktemp("clips")
    noise = np.random.default_rng(0).uniform(-0.3, 0.3, size=(11025, 2))
    sine = 0.4 * np.sin(2 * np.pi * 220 * np.arange(4000) / 8000)
    written = [
        ("speech.wav", synthesize(TRANSCRIPTS[0]), 16000),
        ("hum.flac", sine, 8000),
        ("static.wav", noise, 44100),
        ("path.flac", synthesize(TRANSCRIPTS[3], sampling_rate=22050), 22050),
    ]
    paths = []
    for name, samples, rate in written:
        paths.append(str(directory / name))
        soundfile.write(paths[-1], samples, rate)
    return paths


def _audio_dataset(clips: list[str]) -> datasets.Dataset:
    """A ``text`` column and an ``Audio`` column: the first three files' bytes, and the last
    one by its path only. (Built as plain structs and cast: encoding examples through the
    ``Audio`` feature would need torchcodec.)"""
    audio = [{"bytes": Path(path).read_bytes(), "path": os.path.basename(path)} for path in clips[:-1]]
    audio.append({"bytes": None, "path": clips[-1]})
    rows = {"audio": audio, "text": TRANSCRIPTS[: len(clips)]}
    return datasets.Dataset.from_dict(rows).cast_column("audio", Audio())


@pytest.fixture
def saved(tmp_path, clips):
    """The dataset written by ``save_to_disk`` (which embeds the file read by path)."""
    path = str(tmp_path / "saved")
    _audio_dataset(clips).save_to_disk(path)
    return path


@pytest.fixture
def parquet_dir(tmp_path, clips):
    """The dataset as a directory of Parquet files; the ``Audio`` feature travels in the
    file's schema metadata, and the last row keeps only its path."""
    path = tmp_path / "parquet"
    (path / "data").mkdir(parents=True)
    _audio_dataset(clips).to_parquet(str(path / "data" / "train-00000-of-00001.parquet"))
    return str(path)


def _all_records(source: HfSourceConfig, split: str = "train") -> list:
    return [record for shard in source.shards(split) for record in source.records(split, shard)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("data", ["saved", "parquet_dir"])
def test_audio_columns_arrive_undecoded_and_decode_to_the_files_samples(data, stream, clips, request):
    path = request.getfixturevalue(data)
    loaded = datasets.load_from_disk(path) if data == "saved" else datasets.load_dataset(path, split="train")
    assert loaded.features["audio"] == Audio()  # datasets itself would decode it, with torchcodec

    records = _all_records(HfSourceConfig(id=path, stream=stream))
    assert [set(r.value["audio"]) for r in records] == [{"bytes", "path"}] * len(clips)
    assert all(isinstance(r.value["audio"]["bytes"], bytes) for r in records[:-1])
    for record, clip, transcript in zip(records, clips, TRANSCRIPTS):
        utterance = parse_record(record.value, record.where, base=path)
        assert utterance.text == transcript
        np.testing.assert_array_equal(utterance.audio, load_audio(clip))
    shard = "shard[0/1]:" if stream else ""
    assert records[2].where == f"{path}:train:{shard}row 2"


def test_streaming_and_preparing_give_the_same_records(saved, parquet_dir):
    for path in (saved, parquet_dir):
        prepared = [r.value for r in _all_records(HfSourceConfig(id=path))]
        assert [r.value for r in _all_records(HfSourceConfig(id=path, stream=True))] == prepared
    # save_to_disk embedded the file given by path (keeping its name); Parquet kept the path
    saved_last, parquet_last = (_all_records(HfSourceConfig(id=p))[-1].value["audio"] for p in (saved, parquet_dir))
    assert saved_last["bytes"] is not None and saved_last["path"] == "path.flac"
    assert parquet_last["bytes"] is None and parquet_last["path"].endswith("path.flac")


def test_a_prepared_audio_dataset_keeps_its_own_fingerprint(saved):
    fingerprint = HfSourceConfig(id=saved).fingerprint("train")
    assert set(fingerprint["shards"].values()) == {datasets.load_from_disk(saved)._fingerprint}


def test_audio_inside_structs_and_lists_is_undecoded_too(tmp_path, clips):
    features = Features({"clips": List(Audio()), "meta": {"clip": Audio(), "speaker": Value("string")}})
    clip = {"bytes": Path(clips[1]).read_bytes(), "path": "hum.flac"}
    rows = {"clips": [[clip, clip]], "meta": [{"clip": clip, "speaker": "s1"}]}
    path = str(tmp_path / "nested")
    datasets.Dataset.from_dict(rows).cast(features).save_to_disk(path)
    for stream in (False, True):
        (record,) = _all_records(HfSourceConfig(id=path, stream=stream))
        assert record.value == {"clips": [clip, clip], "meta": {"clip": clip, "speaker": "s1"}}


def test_the_threaded_decoding_of_hub_streams_is_switched_off_too(parquet_dir, clips, monkeypatch):
    """``load_dataset`` decodes a hub stream's media in worker threads (not a local one's):
    the source reads such a stream undecoded all the same."""
    load_dataset = datasets.load_dataset

    def as_from_the_hub(*args, **kwargs):
        loaded = load_dataset(*args, **kwargs)
        if kwargs.get("streaming"):
            return datasets.IterableDatasetDict({name: ds.decode(num_threads=2) for name, ds in loaded.items()})
        return loaded

    monkeypatch.setattr(datasets, "load_dataset", as_from_the_hub)
    records = _all_records(HfSourceConfig(id=parquet_dir, stream=True))
    assert [r.value["text"] for r in records] == TRANSCRIPTS
    speech = parse_record(records[0].value, records[0].where, base=parquet_dir)
    np.testing.assert_array_equal(speech.audio, load_audio(clips[0]))


@pytest.mark.parametrize("stream", [False, True])
def test_garbage_audio_bytes_are_a_data_error_naming_the_row(tmp_path, clips, stream):
    dataset = _audio_dataset(clips[:2])
    rows = {"audio": [{"bytes": b"not audio at all", "path": "bad.wav"}], "text": ["noise"]}
    garbage = datasets.Dataset.from_dict(rows).cast_column("audio", Audio())
    path = str(tmp_path / "with-garbage")
    datasets.concatenate_datasets([dataset, garbage]).save_to_disk(path)
    records = _all_records(HfSourceConfig(id=path, stream=stream))
    shard = "shard[0/1]:" if stream else ""
    with pytest.raises(DataError, match="^" + re.escape(f"{path}:train:{shard}row 2: audio bytes")):
        parse_record(records[2].value, records[2].where, base=path)
