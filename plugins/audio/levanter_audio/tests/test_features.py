import numpy as np
import pytest

from levanter_audio import features
from levanter_audio.features import HOP_LENGTH, N_FRAMES, N_SAMPLES, log_mel_spectrogram, mel_filter_bank

transformers = pytest.importorskip("transformers")

# Hugging Face's extractor is the reference; its torch path (torch is installed for tests)
# is what Whisper users get.
TOLERANCE = 1e-4


def _clips(speech):
    rng = np.random.default_rng(0)
    short, medium, long = speech
    sentence_gap = np.zeros(4000, np.float32)
    # more than 30 s of speech: the extractor cuts it to 30 s
    over_30_s = np.concatenate([long, sentence_gap] * (1 + N_SAMPLES // (len(long) + len(sentence_gap))))
    noisy = medium + (0.02 * rng.standard_normal(len(medium))).astype(np.float32)
    noise = (0.1 * rng.standard_normal(16000 * 7)).astype(np.float32)
    return {"short": short, "sentence": medium, "noisy": noisy, "over 30 s": over_30_s, "noise": noise}


@pytest.mark.parametrize("n_mels", [80, 128])
def test_features_match_whisper_feature_extractor(speech, n_mels):
    extractor = transformers.WhisperFeatureExtractor(feature_size=n_mels)
    for name, clip in _clips(speech).items():
        reference = extractor(clip, sampling_rate=16000, return_tensors="np", return_attention_mask=True)
        ours = log_mel_spectrogram(clip, n_mels=n_mels)
        assert ours.features.shape == (n_mels, N_FRAMES) and ours.features.dtype == np.float32
        difference = np.abs(ours.features - reference["input_features"][0]).max()
        assert difference < TOLERANCE, f"{name}: max abs difference {difference}"
        assert ours.num_frames == reference["attention_mask"][0].sum(), name


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filter_bank_matches_transformers(n_mels):
    from transformers.audio_utils import mel_filter_bank as reference

    expected = reference(
        num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0, max_frequency=8000.0,
        sampling_rate=16000, norm="slaney", mel_scale="slaney",
    )  # fmt: skip
    np.testing.assert_allclose(mel_filter_bank(n_mels), expected, rtol=0, atol=1e-12)


def test_hann_window_is_torchs():
    torch = pytest.importorskip("torch")
    expected = torch.hann_window(400, dtype=torch.float64).numpy()
    np.testing.assert_allclose(features.hann_window(400), expected, atol=1e-15)


def test_valid_frames():
    assert features.num_valid_frames(1) == 1
    assert features.num_valid_frames(160) == 1
    assert features.num_valid_frames(161) == 2
    assert features.num_valid_frames(N_SAMPLES * 2) == N_FRAMES


def test_jax_features_match_numpy(speech):
    jax = pytest.importorskip("jax")
    clips = [speech[1], speech[2]]
    batch = np.stack([features.pad_or_trim(c) for c in clips])
    on_device = np.asarray(jax.jit(lambda a: features.log_mel_spectrogram_jax(a, n_mels=80))(batch))
    assert on_device.shape == (2, 80, N_FRAMES)
    for clip, row in zip(clips, on_device):
        assert np.abs(row - log_mel_spectrogram(clip).features).max() < TOLERANCE


def test_a_shorter_window_gives_the_first_frames_of_the_30_second_features(speech):
    """A small model hears a shorter window (``2 * max_source_positions`` frames): for a clip that
    ends inside it, the features are the first frames of Whisper's 30-second features."""
    import jax

    clip = speech[1]  # about 3 s
    window = 400 * HOP_LENGTH  # 4 s
    short = np.asarray(jax.jit(features.log_mel_spectrogram_jax)(features.pad_or_trim(clip, window)[None]))[0]
    whole = log_mel_spectrogram(clip).features
    assert short.shape == (80, 400)
    np.testing.assert_allclose(short, whole[:, :400], atol=TOLERANCE)
    with pytest.raises(ValueError, match="multiple of 160 samples"):
        features.log_mel_spectrogram_jax(np.zeros((1, 1000), np.float32))
