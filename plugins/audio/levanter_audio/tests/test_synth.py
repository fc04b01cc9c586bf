import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from levanter_audio.synth import DETERMINISTIC_VOICES, make_speech_corpus, synthesize
from levanter_core.errors import UserError


def _digest(audio: np.ndarray) -> str:
    return hashlib.sha256(audio.tobytes()).hexdigest()


def test_speech_is_audible_16khz_float32():
    audio = synthesize("The quick brown fox jumps over the lazy dog.")
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert 1.5 < len(audio) / 16000 < 5.0  # a nine-word sentence lasts seconds
    assert 0.1 < np.abs(audio).max() <= 1.0
    frames = audio[: len(audio) // 400 * 400].reshape(-1, 400)
    voiced = np.sqrt((frames**2).mean(axis=1)) > 0.01
    assert voiced.mean() > 0.3  # mostly speech, not silence


def test_same_sentence_same_samples_whatever_came_before():
    first = synthesize("Hello world.")
    for other in ["Something else entirely, and longer.", "Numbers: seven, eight, nine?"]:
        synthesize(other)
        np.testing.assert_array_equal(synthesize("Hello world."), first)
    assert not np.array_equal(first, synthesize("Hello world!"))


def test_same_samples_in_another_process():
    code = (
        "import hashlib; from levanter_audio.synth import synthesize; synthesize('Warm up first.'); "
        "print(hashlib.sha256(synthesize('Hello world.').tobytes()).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == _digest(synthesize("Hello world."))


def test_length_grows_with_the_sentence():
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    lengths = [len(synthesize(" ".join(words[:n]))) for n in (1, 3, 6, 12)]
    assert lengths == sorted(lengths) and lengths[-1] > 4 * lengths[0]
    slow, fast = (synthesize("One two three.", words_per_minute=wpm) for wpm in (100, 250))
    assert len(slow) > len(fast)


def test_every_listed_voice_speaks_and_others_are_refused():
    digests = {_digest(synthesize("Hello.", voice=voice)) for voice in DETERMINISTIC_VOICES}
    assert len(digests) == len(DETERMINISTIC_VOICES)
    with pytest.raises(UserError, match="'en-us' does not speak deterministically"):
        synthesize("Hello.", voice="en-us")
    with pytest.raises(UserError, match="no voice 'zz-top\\+Storm'"):
        synthesize("Hello.", voice="zz-top+Storm")
    with pytest.raises(UserError, match="empty sentence"):
        synthesize("  ")


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_corpus_files_and_manifest(tmp_path, fmt):
    sentences = ["One small step.", "A giant leap for mankind."]
    manifest = make_speech_corpus(tmp_path / "corpus", sentences, fmt=fmt, voice=["en-us+Storm", "en-us+shelby"])
    assert manifest == str(tmp_path / "corpus" / "manifest.jsonl")
    records = [json.loads(line) for line in open(manifest)]
    assert records == [{"audio": f"00000.{fmt}", "text": sentences[0]}, {"audio": f"00001.{fmt}", "text": sentences[1]}]
    audio, rate = soundfile.read(tmp_path / "corpus" / f"00001.{fmt}", dtype="float32")
    assert rate == 16000
    expected = synthesize(sentences[1], voice="en-us+shelby")
    assert np.abs(audio - expected).max() <= 1 / 32768 + 1e-7  # 16-bit files
    with pytest.raises(UserError, match="fmt must be one of wav, flac"):
        make_speech_corpus(tmp_path / "x", sentences, fmt="mp4")


def test_command_line(tmp_path, capsys):
    from levanter_audio.synth import main

    (tmp_path / "sentences.txt").write_text("Good morning.\n\nGood night.\n")
    assert main([str(tmp_path / "out"), "--sentences", str(tmp_path / "sentences.txt"), "--fmt", "flac"]) == 0
    manifest = capsys.readouterr().out.strip()
    assert [json.loads(line)["text"] for line in open(manifest)] == ["Good morning.", "Good night."]
    assert main([str(tmp_path / "out"), "--sentences", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"sentences 1 \(counting from 0\) are empty"):
        make_speech_corpus(tmp_path / "x", ["fine", " "])
