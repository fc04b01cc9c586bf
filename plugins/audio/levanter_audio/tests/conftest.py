import numpy as np
import pytest


@pytest.fixture(scope="session")
def speech():
    """Three sentences of synthesized speech at 16 kHz, shortest first."""
    from levanter_audio.synth import synthesize

    sentences = [
        "Yes.",
        "The quick brown fox jumps over the lazy dog.",
        "Speech recognition turns a recording of someone talking into the words they said, one after another.",
    ]
    return [synthesize(s) for s in sentences]


def sine(frequency: float, rate: int, seconds: float = 1.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def peak_frequency(audio: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(audio * np.hanning(len(audio))))
    return float(np.argmax(spectrum) * rate / len(audio))
