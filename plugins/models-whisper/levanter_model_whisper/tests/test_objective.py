"""The ``asr`` objective through the core's trainer: Whisper learns to transcribe speech
synthesized on this machine (eSpeak NG, ``levanter-audio``), with microbatches, evaluation sums
its transcripts' cross-entropy, and greedy transcription then hears every sentence. A run whose
data is text is refused by name."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from haliax import Axis

from levanter_core.config.loader import Sources
from levanter_core.config.train import validate_train_config
from levanter_core.errors import ConfigError
from levanter_core.trainer.mesh import make_mesh
from levanter_core.trainer.trainer import Trainer

SENTENCES = ["the cat sat", "a dog ran home", "red sky at night", "we like green tea"]
START, END = 257, 256  # a byte-level transcript: start token, the text's bytes, end-of-text
SEQ_LEN = 24
STEPS = 150
FRAMES = 400


def _speech_batch(sentences, n_mels: int):
    from levanter_audio.features import log_mel_spectrogram
    from levanter_audio.synth import synthesize

    from levanter_model_whisper.objective import SpeechBatch

    # the first 4 seconds of Whisper's 30-second window hold every sentence (a small model's
    # encoder takes a shorter spectrogram: max_source_positions 200 is 400 frames)
    features = np.stack([log_mel_spectrogram(synthesize(s), n_mels=n_mels).features[:, :FRAMES] for s in sentences])
    tokens = np.zeros((len(sentences), SEQ_LEN), np.int32)
    mask = np.zeros((len(sentences), SEQ_LEN), np.float32)
    for row, sentence in enumerate(sentences):
        ids = [START, *sentence.encode(), END]
        tokens[row, : len(ids)] = ids
        mask[row, : len(ids) - 1] = 1  # every position whose next token is the transcript's
    return SpeechBatch(features, tokens, mask)


def _config(tmp_path, **trainer):
    raw = {
        "data": {"tokenizer": "byte", "train_urls": ["unused.jsonl"]},
        "model": {"type": "whisper", "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                  "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
                  "decoder_ffn_dim": 128, "num_mel_bins": 80, "max_source_positions": FRAMES // 2, "max_length": SEQ_LEN},
        "trainer": {"train_batch_size": 4, "num_train_steps": STEPS, "log_dir": str(tmp_path / "logs"),
                    "checkpointer": {"base_path": str(tmp_path / "ckpt")}, **trainer},
        "optimizer": {"learning_rate": 3e-3, "warmup": 0, "lr_schedule": "constant", "weight_decay": 0.0},
    }  # fmt: skip
    return validate_train_config(raw, Sources("test"))


@pytest.mark.slow
def test_whisper_learns_synthesized_speech_through_the_trainer(tmp_path):
    from levanter_model_whisper.objective import SpeechRecognition

    config = _config(tmp_path, per_device_parallelism=2, per_device_eval_parallelism=4)  # two microbatches of two utterances
    Vocab = Axis("vocab", 260)
    objective = SpeechRecognition()
    trainer = Trainer(config.trainer, config.optimizer.build_for_trainer(STEPS), objective, mesh=make_mesh(config.trainer))
    assert trainer.plan.num_microbatches == 2
    state = trainer.init_state(lambda key: config.model.build(Vocab, key=key), jax.random.PRNGKey(0))
    batch = _speech_batch(SENTENCES, n_mels=80)

    first = trainer.evaluate_totals(state.model, [batch])
    losses = []
    for _ in range(STEPS):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["train/loss"]))
    last = trainer.evaluate_totals(state.model, [batch])

    tokens = sum(len(s) + 1 for s in SENTENCES)  # each transcript's bytes and its end, after the start
    assert first[1] == last[1] == tokens
    # evaluation scores what training does (training averages two microbatches' own means)
    assert first[0] / first[1] == pytest.approx(losses[0], rel=1e-2)
    assert losses[-1] < 0.25 * losses[0]
    assert last[0] / last[1] < 0.25 * first[0] / first[1]

    from levanter_model_whisper.transcribe import greedy_transcribe, word_error_rate

    heard = greedy_transcribe(state.model, batch.features, prompt=[START], end_id=END, max_tokens=SEQ_LEN - 1)
    texts = [bytes(b for b in ids if b < 256).decode(errors="replace") for ids in heard]
    assert word_error_rate(SENTENCES, texts) == 0.0, texts  # it listens: every sentence, word for word


def test_a_run_whose_data_is_text_is_refused_by_name(tmp_path):
    from levanter_model_whisper.objective import SpeechRecognition

    with pytest.raises(ConfigError, match="model.type 'whisper' trains with the asr objective, which needs audio"):
        SpeechRecognition.from_config(_config(tmp_path))


def test_word_error_rate_counts_substitutions_deletions_and_insertions():
    from levanter_model_whisper.transcribe import word_error_rate

    assert word_error_rate(["the cat sat"], ["the cat sat"]) == 0.0
    assert word_error_rate(["the cat sat"], ["the bat sat"]) == pytest.approx(1 / 3)
    assert word_error_rate(["the cat sat", "a dog"], ["the cat", "a big dog"]) == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="2 references but 1 hypotheses"):
        word_error_rate(["a", "b"], ["a"])
