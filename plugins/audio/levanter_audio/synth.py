"""Speech synthesized on this machine, for tests and for small offline corpora.

`eSpeak NG <https://github.com/espeak-ng/espeak-ng>`_ is a formant synthesizer: robotic,
but real, intelligible speech from any English sentence, in about a millisecond per
sentence, with nothing to download. The registry package ``espeakng-loader`` ships its
shared library and its data; this module calls the library through ``ctypes`` in
synchronous mode, collecting the 22,050 Hz samples that its callback receives, and
resamples them to 16 kHz.

**Determinism.** eSpeak keeps some state from one sentence to the next in the library
itself: the phase of its pitch *flutter* (a slow wobble of the pitch) and the random
numbers of its *roughness*. Voices that switch both off speak every sentence identically,
whatever was spoken before and in whichever process. So a voice here is a language and a
variant whose file sets ``flutter 0`` and ``roughness 0`` (:data:`DETERMINISTIC_VOICES`
lists the English ones); any other voice is refused."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import espeakng_loader
import numpy as np
import soundfile

from levanter_audio.io import SAMPLE_RATE, resample
from levanter_audio.sentences import random_sentences
from levanter_core.errors import UserError

DEFAULT_VOICE = "en-us+Storm"
"""A low male American English voice."""

DETERMINISTIC_VOICES = (
    "en-us+Storm",
    "en-us+Denis",
    "en-us+shelby",
    "en-us+Diogo",
    "en-us+Henrique",
    "en-us+Hugo",
    "en-us+michel",
    "en-us+miguel",
)
"""English voices that speak deterministically (their variants set flutter and roughness
to 0); ``en-us`` may be replaced by another of eSpeak's languages (``en-gb``, ``fr``...)."""

# espeak_AUDIO_OUTPUT, espeak_POSITION_TYPE, flags and parameters of speak_lib.h
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_INITIALIZE_DONT_EXIT = 0x8000  # fail with a status instead of calling exit()
_RATE, _VOLUME = 1, 2
_EE_OK = 0
# eSpeak's default volume (100) clips some voices (Storm, miguel) at full scale.
_VOLUME_PERCENT = 60
_FULL_SCALE = 32768.0

_SynthCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class _Espeak:
    """The library, loaded and initialised once per process. eSpeak is one global
    synthesizer: calls are serialised by a lock."""

    def __init__(self):
        self.data_dir = Path(espeakng_loader.get_data_path())
        try:
            lib = ctypes.CDLL(espeakng_loader.get_library_path())
        except OSError as e:
            raise UserError(f"cannot load eSpeak NG's library from espeakng-loader: {e}") from None
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_SynthCallback]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        # The path is the directory that holds espeak-ng-data/.
        rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 0, str(self.data_dir.parent).encode(), _INITIALIZE_DONT_EXIT
        )
        if rate <= 0:
            raise UserError(f"eSpeak NG did not start (status {rate}) with its data in {self.data_dir}")
        self.rate = rate
        self.lib = lib
        self.lock = threading.Lock()
        self._chunks: list[np.ndarray] = []
        self._callback = _SynthCallback(self._collect)  # kept referenced while the library holds it
        lib.espeak_SetSynthCallback(self._callback)

    def _collect(self, wav, count, events) -> int:
        if wav and count > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0  # go on

    def speak(self, text: str, voice: str, words_per_minute: int) -> np.ndarray:
        with self.lock:
            status = self.lib.espeak_SetVoiceByName(voice.encode())
            if status != _EE_OK:
                raise UserError(f"eSpeak NG has no voice {voice!r} (status {status}); try {DEFAULT_VOICE!r}")
            # Parameters are global: set each one every time, so no call depends on an earlier one.
            self.lib.espeak_SetParameter(_RATE, words_per_minute, 0)
            self.lib.espeak_SetParameter(_VOLUME, _VOLUME_PERCENT, 0)
            buffer = text.encode("utf-8") + b"\0"
            self._chunks = []
            status = self.lib.espeak_Synth(buffer, len(buffer), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
            chunks, self._chunks = self._chunks, []
        if status != _EE_OK:
            raise UserError(f"eSpeak NG could not speak {text!r} (status {status})")
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)

    def check_voice(self, voice: str) -> None:
        """Refuse a voice that does not speak deterministically (see the module's description)."""
        _, _, variant = voice.partition("+")
        settings = {}
        path = self.data_dir / "voices" / "!v" / variant
        if variant and path.is_file():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                words = line.split()
                if len(words) >= 2:
                    settings[words[0].lower()] = words[1]
        if settings.get("flutter") != "0" or settings.get("roughness") != "0":
            raise UserError(
                f"voice {voice!r} does not speak deterministically: its variant must set flutter 0 and "
                f"roughness 0; choose one of {', '.join(DETERMINISTIC_VOICES)}"
            )


_engine: _Espeak | None = None
_engine_lock = threading.Lock()


def _espeak() -> _Espeak:
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = _Espeak()
        return _engine


def synthesize(
    text: str,
    *,
    voice: str = DEFAULT_VOICE,
    words_per_minute: int = 175,
    sampling_rate: int = SAMPLE_RATE,
) -> np.ndarray:
    """``text`` spoken by eSpeak NG: mono float32 in [-1, 1] at ``sampling_rate``.
    The same arguments give the same samples, in any process, whatever was spoken before.

    Raises :class:`UserError` for empty text, a voice eSpeak does not have or that is not
    deterministic, or text that gives no sound."""
    if not text or not text.strip():
        raise UserError("cannot synthesize an empty sentence")
    engine = _espeak()
    engine.check_voice(voice)
    samples = engine.speak(text, voice, int(words_per_minute))
    if samples.size == 0:
        raise UserError(f"eSpeak NG produced no sound for {text!r}")
    return resample(samples.astype(np.float32) / _FULL_SCALE, engine.rate, sampling_rate)


def make_speech_corpus(
    directory: str | os.PathLike,
    sentences: Sequence[str],
    *,
    fmt: str = "wav",
    voice: str | Sequence[str] = DEFAULT_VOICE,
    words_per_minute: int = 175,
    manifest_name: str = "manifest.jsonl",
) -> str:
    """Speak each sentence into its own 16 kHz audio file in ``directory``
    (``00000.wav``, ``00001.wav``, ... or ``.flac``) and write the JSON-lines manifest
    ``directory/manifest_name``, one ``{"audio": file, "text": sentence}`` per line with
    each file's path relative to the manifest. A list of voices is used in turn, one
    sentence each. Returns the manifest's path. The same arguments write the same audio."""
    formats = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16")}
    if fmt not in formats:
        raise UserError(f"fmt must be one of {', '.join(formats)}, got {fmt!r}")
    if not sentences:
        raise UserError("make_speech_corpus needs at least one sentence")
    blank = [index for index, sentence in enumerate(sentences) if not sentence or not sentence.strip()]
    if blank:
        raise UserError(f"sentences {', '.join(map(str, blank))} (counting from 0) are empty")
    voices = [voice] if isinstance(voice, str) else list(voice)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    width = max(5, len(str(len(sentences) - 1)))
    lines = []
    for index, sentence in enumerate(sentences):
        audio = synthesize(sentence, voice=voices[index % len(voices)], words_per_minute=words_per_minute)
        name = f"{index:0{width}d}.{fmt}"
        soundfile.write(directory / name, audio, SAMPLE_RATE, format=formats[fmt][0], subtype=formats[fmt][1])
        lines.append(json.dumps({"audio": name, "text": sentence}, ensure_ascii=False))
    manifest = directory / manifest_name
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(manifest)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m levanter_audio.synth DIRECTORY (--sentences FILE | --random N [--seed S])
    [--fmt flac] [--voice V ...]``: write a corpus and print its manifest's path (for set-up
    scripts). ``--random``: ``N`` sentences of :func:`levanter_audio.sentences.random_sentences`."""
    parser = argparse.ArgumentParser(
        prog="python -m levanter_audio.synth",
        description="Speak sentences with eSpeak NG into 16 kHz audio files and a JSON-lines manifest.",
    )
    parser.add_argument("directory", help="where the audio files and manifest.jsonl go")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--sentences", help="a text file, one sentence per non-blank line")
    given.add_argument("--random", type=int, metavar="N", help="N simple sentences drawn from a small vocabulary")
    parser.add_argument("--seed", type=int, default=0, help="which sentences --random draws (default 0)")
    parser.add_argument("--fmt", choices=["wav", "flac"], default="wav")
    parser.add_argument("--voice", action="append", help=f"repeat to alternate voices (default {DEFAULT_VOICE})")
    parser.add_argument("--words-per-minute", type=int, default=175)
    parser.add_argument("--manifest-name", default="manifest.jsonl")
    args = parser.parse_args(argv)
    try:
        if args.random is not None:
            if args.random < 1:
                raise UserError(f"--random must be at least 1, got {args.random}")
            sentences = random_sentences(args.random, args.seed)
        else:
            with open(args.sentences, encoding="utf-8") as f:
                sentences = [line.strip() for line in f if line.strip()]
        manifest = make_speech_corpus(
            args.directory,
            sentences,
            fmt=args.fmt,
            voice=args.voice or DEFAULT_VOICE,
            words_per_minute=args.words_per_minute,
            manifest_name=args.manifest_name,
        )
    except (UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(manifest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
