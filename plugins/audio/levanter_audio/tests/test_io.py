import io

import numpy as np
import pytest
import soundfile

from levanter_audio.io import load_audio, resample
from levanter_audio.tests.conftest import peak_frequency, sine
from levanter_core.errors import DataError, UserError


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resampling_keeps_frequency_and_scales_length(rate):
    audio = resample(sine(440.0, rate), rate)
    assert audio.dtype == np.float32
    assert abs(len(audio) - 16000) <= 1  # one second stays one second
    assert abs(peak_frequency(audio, 16000) - 440.0) <= 1.0
    # and a 2.5 s clip scales the same way
    assert abs(len(resample(sine(440.0, rate, seconds=2.5), rate)) - 40000) <= 1


@pytest.mark.parametrize(("fmt", "subtype"), [("wav", "PCM_16"), ("flac", "PCM_24"), ("mp3", None), ("ogg", None)])
def test_formats_decode_to_16khz_mono(tmp_path, fmt, subtype):
    left, right = sine(440.0, 44100), sine(440.0, 44100, amplitude=0.3)
    path = tmp_path / f"a.{fmt}"
    soundfile.write(path, np.stack([left, right], axis=1), 44100, subtype=subtype)
    audio = load_audio(path)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) - 16000) <= 1
    assert abs(peak_frequency(audio, 16000) - 440.0) <= 1.0
    # the channels are averaged: the mix has amplitude 0.4 (lossy codecs wobble a little)
    assert np.abs(audio).max() == pytest.approx(0.4, abs=0.03)
    assert np.abs(audio).max() <= 1.0


def test_bytes_and_open_files_decode(tmp_path):
    buffer = io.BytesIO()
    soundfile.write(buffer, sine(300.0, 8000), 8000, format="WAV")
    from_bytes = load_audio(buffer.getvalue())
    buffer.seek(0)
    np.testing.assert_array_equal(from_bytes, load_audio(buffer))
    assert abs(len(from_bytes) - 16000) <= 1


def _wav_bytes(fmt="WAV", seconds=1.0):
    buffer = io.BytesIO()
    soundfile.write(buffer, sine(440.0, 16000, seconds), 16000, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.wav", None, "no such file"),
        ("empty.wav", b"", "empty file (0 bytes)"),
        ("notes.wav", b"these are my notes, not audio\n" * 20, "not an audio file that can be decoded"),
        ("cut.wav", _wav_bytes()[:20000], "truncated: its header announces 32000 bytes of audio data"),
        ("cut.flac", _wav_bytes("FLAC")[:3000], "truncated or corrupt audio data"),
        ("cut.mp3", _wav_bytes("MP3", seconds=3.0)[:2000], "truncated: its header announces 48000 samples"),
    ],
)
def test_bad_files_name_the_file_and_the_problem(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError) as error:
        load_audio(path, where="train.jsonl:7")
    text = str(error.value)
    assert text.startswith(f"train.jsonl:7: audio {path}: ")
    assert message in text
    assert isinstance(error.value, UserError)  # the CLI prints it without a traceback, exit 2


def test_zero_samples_and_directories_are_errors(tmp_path):
    soundfile.write(tmp_path / "zero.wav", np.zeros((0, 1), np.float32), 16000)
    with pytest.raises(DataError, match=r"zero.wav: holds no audio samples \(0 frames\)"):
        load_audio(tmp_path / "zero.wav")
    soundfile.write(tmp_path / "blip.wav", np.full((1, 1), 0.5, np.float32), 48000)
    with pytest.raises(DataError, match="blip.wav: too short: 1 samples at 48000 Hz are none at 16000 Hz"):
        load_audio(tmp_path / "blip.wav")
    with pytest.raises(DataError, match="is a directory"):
        load_audio(tmp_path)
    soundfile.write(tmp_path / "nan.wav", np.full((10, 1), np.nan, np.float32), 16000, subtype="FLOAT")
    with pytest.raises(DataError, match="NaN or infinite"):
        load_audio(tmp_path / "nan.wav")


def test_unreadable_path_is_an_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match=r"file/a.wav: cannot read the file \(Not a directory\)"):
        load_audio(tmp_path / "file" / "a.wav")


def test_fsspec_urls(tmp_path):
    import fsspec

    with fsspec.open("memory://audio-tests/a.flac", "wb") as f:
        f.write(_wav_bytes("FLAC"))
    assert abs(len(load_audio("memory://audio-tests/a.flac")) - 16000) <= 1
    with pytest.raises(DataError, match="memory://audio-tests/b.flac: no such file"):
        load_audio("memory://audio-tests/b.flac")
