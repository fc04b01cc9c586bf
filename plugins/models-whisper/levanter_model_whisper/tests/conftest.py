"""Tiny Hugging Face Whispers and synthesized speech for the transcription tests: nothing is
downloaded."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|en|>",
    "<|fr|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|notimestamps|>",
)
"""Whisper's special tokens (a few of its languages), in the order of its vocabulary."""

SENTENCES = [
    "Yes.",
    "The cat sat on the mat.",
    "Speech recognition turns a recording into the words that were said.",
    "A dog ran home.",
    "Red sky at night, shepherd's delight.",
]


def tiny_hf_whisper(
    directory: str,
    *,
    max_source_positions: int = 1500,
    max_target_positions: int = 32,
    generation_config: dict | None = None,
    seed: int = 0,
) -> str:
    """A random two-layer ``transformers`` Whisper (width 32, 8 mel bins, every parameter perturbed:
    its transcripts depend on the audio) with a byte-level BPE whose added tokens are Whisper's
    special tokens, saved as a Hugging Face model directory. ``max_source_positions`` 1500 is
    Whisper's 30-second window. ``decoder_start_token_id`` is ``<|startoftranscript|>`` and the end of
    text ``<|endoftext|>``; ``generation_config`` (``generation_config.json``) is written when given,
    token texts (``"<|en|>"``) in it replaced by their ids. Returns ``directory``."""
    import transformers
    from tokenizers import Tokenizer

    from levanter_core.hf.parity import random_hf_model
    from levanter_core.testing import train_bpe_tokenizer

    os.makedirs(directory, exist_ok=True)
    path = train_bpe_tokenizer(
        SENTENCES * 4, os.path.join(directory, "tokenizer.json"), vocab_size=300, special_tokens=SPECIAL_TOKENS
    )
    tokenizer = Tokenizer.from_file(path)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    end = ids["<|endoftext|>"]
    config = transformers.WhisperConfig(
        vocab_size=tokenizer.get_vocab_size(), num_mel_bins=8, d_model=32, encoder_layers=2,
        encoder_attention_heads=4, encoder_ffn_dim=64, decoder_layers=2, decoder_attention_heads=2,
        decoder_ffn_dim=48, max_source_positions=max_source_positions, max_target_positions=max_target_positions,
        pad_token_id=end, bos_token_id=end, eos_token_id=end, decoder_start_token_id=ids["<|startoftranscript|>"],
        begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip
    model = random_hf_model(config, seed=seed, noise=0.3, auto_class=transformers.AutoModelForSpeechSeq2Seq)
    model.save_pretrained(directory)
    generation = os.path.join(directory, "generation_config.json")
    if os.path.exists(generation):
        os.remove(generation)  # transformers writes one of its own; the tests decide
    if generation_config is not None:

        def ids_of(value):
            if isinstance(value, str) and value in ids:
                return ids[value]
            if isinstance(value, list):
                return [ids_of(v) for v in value]
            if isinstance(value, dict):
                return {k: ids_of(v) for k, v in value.items()}
            return value

        with open(generation, "w") as f:
            json.dump(ids_of(generation_config), f)
    return directory


@pytest.fixture(scope="session")
def whisper_dir(tmp_path_factory) -> str:
    """A tiny Hugging Face Whisper with a 30-second window, no generation config."""
    return tiny_hf_whisper(str(tmp_path_factory.mktemp("tiny-whisper")))


@pytest.fixture(scope="session")
def speech() -> list[np.ndarray]:
    """:data:`SENTENCES` spoken by eSpeak NG, 16 kHz (one to four seconds each)."""
    from levanter_audio.synth import synthesize

    return [synthesize(s) for s in SENTENCES]
