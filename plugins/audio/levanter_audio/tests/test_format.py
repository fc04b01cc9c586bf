"""``format: {type: audio}`` through the core's cache: each utterance's samples and transcript are
stored as they were read, a bad record is named by its file and line (or skipped and counted),
and the transcripts start and end as the decoder needs."""

import json
import os
import shutil

import numpy as np
import pytest

from levanter_audio.format import AudioFormat, transcript_ids, transcript_prompt
from levanter_audio.io import load_audio
from levanter_audio.synth import make_speech_corpus
from levanter_core.data.cache import open_cache
from levanter_core.data.dataset import sequence_dataset
from levanter_core.data.source import UrlSourceConfig
from levanter_core.data.tokenizer import ByteTokenizer, load_tokenizer
from levanter_core.errors import DataError

BYTE = ByteTokenizer()
SENTENCES = ["the cat sat on the mat", "a dog ran home", "green fish swim", "open the door"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_speech_corpus(tmp_path_factory.mktemp("corpus"), SENTENCES, fmt="flac")


def build(path, manifest, **kwargs):
    source = UrlSourceConfig(train_urls=[str(manifest)], format={"type": "audio"})
    options = dict(enforce_eos=True, skip_bad_data=False, background=False, num_workers=1) | kwargs
    return open_cache(str(path), source, "train", BYTE, **options)


def test_the_format_is_registered_and_keys_the_cache():
    source = UrlSourceConfig(train_urls=["m.jsonl"], format={"type": "audio", "text_key": "sentence"})
    assert isinstance(source.format, AudioFormat) and source.format.layout == "document"
    assert source.format.document_fields() == {"audio": "float32"}
    assert AudioFormat().fingerprint() != AudioFormat(enforce_bos=False).fingerprint()


def test_each_utterance_is_stored_as_read(corpus, tmp_path):
    cache = build(tmp_path / "cache", corpus)
    assert cache.num_documents == 4 and cache.fields == {"audio": "float32"}
    directory = os.path.dirname(corpus)
    for i, samples in enumerate(cache.document_field("audio", range(4))):
        np.testing.assert_array_equal(samples, load_audio(os.path.join(directory, f"{i:05d}.flac")))
    offsets = cache.document_offsets()
    # the byte tokenizer has no BOS: its end-of-text token starts each transcript and ends it
    assert BYTE.decode(cache.tokens(int(offsets[1]), int(offsets[2]))) == "<|endoftext|>a dog ran home<|endoftext|>"

    rows = sequence_dataset(cache, 32, layout="document", field_lengths={"audio": 16000}).rows(np.array([2]))
    assert rows.fields["audio"].shape == (1, 16000) and rows.loss_mask[0].sum() == len("green fish swim") + 1


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing", "manifest.jsonl:3: audio {dir}/00002.flac: no such file"),
        ("empty", "manifest.jsonl:3: audio {dir}/00002.flac: empty file (0 bytes)"),
        ("garbage", "manifest.jsonl:3: audio {dir}/00002.flac: not an audio file"),
        ("truncated", "manifest.jsonl:3: audio {dir}/00002.wav: truncated"),
        ("no transcript", "manifest.jsonl:3: no 'text' field (the transcript)"),
    ],
)
def test_a_bad_record_is_named_by_file_and_line_and_can_be_skipped(corpus, tmp_path, damage, message):
    directory = tmp_path / "copy"
    shutil.copytree(os.path.dirname(corpus), directory)
    manifest = directory / "manifest.jsonl"
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    clip = directory / "00002.flac"
    if damage == "missing":
        clip.unlink()
    elif damage == "empty":
        clip.write_bytes(b"")
    elif damage == "garbage":
        clip.write_bytes(b"this is not audio at all" * 40)
    elif damage == "truncated":
        import soundfile

        wav = directory / "00002.wav"
        soundfile.write(wav, load_audio(clip), 16000, subtype="PCM_16")
        wav.write_bytes(wav.read_bytes()[: wav.stat().st_size // 2])
        lines[2]["audio"] = "00002.wav"
    else:
        del lines[2]["text"]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))

    with pytest.raises(DataError) as raised:
        build(tmp_path / "cache", manifest)
    expected = message.format(dir=directory)
    assert expected in str(raised.value) and "set data.skip_bad_data: true" in str(raised.value)

    kept = build(tmp_path / "skipping", manifest, skip_bad_data=True)
    assert kept.num_documents == 3 and sum(kept.skipped().values()) == 1
    assert expected in kept.problems()[0]


def test_transcripts_start_as_the_decoder_needs(tmp_path):
    # the byte tokenizer adds nothing and has no BOS: the end-of-text token starts a transcript
    assert transcript_prompt(BYTE) == [BYTE.eos_id]
    assert transcript_ids(BYTE, ["hi"])[0].tolist() == [BYTE.eos_id, ord("h"), ord("i")]
    assert transcript_ids(BYTE, ["hi"], enforce_bos=False)[0].tolist() == [ord("h"), ord("i")]
    assert transcript_prompt(BYTE, enforce_bos=False) == []

    # a tokenizer that puts its own tokens before a text (as Whisper's <|startoftranscript|>
    # <|notimestamps|>) gets nothing more: its own tokens are the prompt
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<|endoftext|>": 0, "<|startoftranscript|>": 1, "<|notimestamps|>": 2, "a": 3, "b": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftranscript|> <|notimestamps|> $A <|endoftext|>",
        special_tokens=[("<|startoftranscript|>", 1), ("<|notimestamps|>", 2), ("<|endoftext|>", 0)],
    )
    directory = tmp_path / "whisperish"
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"})
    )
    whisperish = load_tokenizer(str(directory))
    assert transcript_prompt(whisperish) == [1, 2]
    assert transcript_ids(whisperish, ["ab"])[0].tolist() == [1, 2, 3, 4, 0]


def test_a_hugging_face_dataset_with_an_audio_column(corpus, tmp_path):
    """The same utterances as a saved Hugging Face dataset (levanter-data-hf reads its Audio column
    undecoded) give the same cached samples and transcripts as the manifest."""
    datasets = pytest.importorskip("datasets")
    hf_source = pytest.importorskip("levanter_data_hf.source")

    directory = os.path.dirname(corpus)
    rows = {
        "audio": [
            {"bytes": open(os.path.join(directory, f"{i:05d}.flac"), "rb").read(), "path": f"{i:05d}.flac"}
            for i in range(4)
        ],
        "sentence": SENTENCES,
    }
    dataset = datasets.Dataset.from_dict(rows).cast_column("audio", datasets.Audio())
    dataset.save_to_disk(str(tmp_path / "saved"))
    source = hf_source.HfSourceConfig(id=str(tmp_path / "saved"), format={"type": "audio", "text_key": "sentence"})
    from_hf = open_cache(
        str(tmp_path / "hf"), source, "train", BYTE, enforce_eos=True, skip_bad_data=False, background=False
    )
    from_manifest = build(tmp_path / "manifest", corpus)
    for a, b in zip(from_hf.document_field("audio", range(4)), from_manifest.document_field("audio", range(4))):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        from_hf.tokens(0, from_hf.num_tokens), from_manifest.tokens(0, from_manifest.num_tokens)
    )
