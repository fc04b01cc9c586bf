"""The ``asr`` objective through the core's trainer: Whisper learns to transcribe speech
synthesized on this machine (eSpeak NG, ``levanter-audio``) from the samples (features computed
in the step), with microbatches; evaluation sums its transcripts' cross-entropy and the word
errors of its greedy transcripts, which end at none. A run whose data is text is refused by
name."""

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
END = 256  # a byte-level transcript: end-of-text (which also starts it), the text's bytes, end-of-text
SEQ_LEN = 24
STEPS = 80  # word for word from step 50 on (loss a thirtieth of the first): 30 steps to spare
FRAMES = 400  # a small model's window: max_source_positions 200 is 400 frames, 4 s (64,000 samples)


def _speech_batch(sentences):
    from levanter_audio.features import pad_or_trim
    from levanter_audio.synth import synthesize

    from levanter_model_whisper.objective import SpeechBatch

    audio = np.stack([pad_or_trim(synthesize(s), FRAMES * 160) for s in sentences])
    tokens = np.zeros((len(sentences), SEQ_LEN), np.int32)
    mask = np.zeros((len(sentences), SEQ_LEN), np.float32)
    for row, sentence in enumerate(sentences):
        ids = [END, *sentence.encode(), END]
        tokens[row, : len(ids)] = ids
        mask[row, : len(ids) - 1] = 1  # every position whose next token is the transcript's
    return SpeechBatch(audio, tokens, mask)


def _config(tmp_path, data=None, **trainer):
    raw = {
        "data": {"tokenizer": "byte", "train_urls": ["unused.jsonl"], **(data or {})},
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

    config = _config(
        tmp_path, per_device_parallelism=2, per_device_eval_parallelism=4
    )  # two microbatches of two utterances
    assert config.data.configs["main"].format.type == "audio"  # what a Whisper model's sources default to
    Vocab = Axis("vocab", 260)
    objective = SpeechRecognition.from_config(config)
    assert objective.prompt == [END] and objective.row_lengths(config.model) == {"audio": FRAMES * 160}
    trainer = Trainer(
        config.trainer, config.optimizer.build_for_trainer(STEPS), objective, mesh=make_mesh(config.trainer)
    )
    assert trainer.plan.num_microbatches == 2
    state = trainer.init_state(lambda key: config.model.build(Vocab, key=key), jax.random.PRNGKey(0))
    batch = _speech_batch(SENTENCES)

    first = trainer.evaluate_totals(state.model, [batch])
    losses = []
    for _ in range(STEPS):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["train/loss"]))
    last = trainer.evaluate_totals(state.model, [batch])

    tokens = sum(len(s) + 1 for s in SENTENCES)  # each transcript's bytes and its end, after the start
    words = sum(len(s.split()) for s in SENTENCES)
    assert first[1] == last[1] == tokens
    # evaluation scores what training does (training averages two microbatches' own means)
    assert first[0] / first[1] == pytest.approx(losses[0], rel=1e-2)
    assert losses[-1] < 0.25 * losses[0]
    assert last[0] / last[1] < 0.25 * first[0] / first[1]
    # word errors and reference words: an untrained model hears nothing right; the trained one
    # transcribes every sentence word for word
    assert first[3] == last[3] == words and first[2] >= words
    assert last[2] == 0
    metrics = objective.eval_metrics({"main": last}, {}, per_set=False)
    assert metrics["eval/wer"] == 0.0 and metrics["eval/loss"] == pytest.approx(last[0] / last[1])


def test_a_run_whose_data_is_text_is_refused_by_name(tmp_path):
    from levanter_model_whisper.objective import SpeechRecognition

    config = _config(tmp_path, data={"format": {"type": "text"}})
    with pytest.raises(ConfigError, match="model.type 'whisper' trains with the asr objective, which reads audio"):
        SpeechRecognition.from_config(config)


def test_word_errors_compare_normalized_words():
    from levanter_model_whisper.objective import word_errors

    assert word_errors("The cat, sat.", "the cat sat") == (0, 3)
    assert word_errors("the cat sat", "the bat sat on") == (2, 3)
    assert word_errors("it's here", "its here") == (1, 2)  # an apostrophe is part of a word
    assert word_errors("a b", "") == (2, 2)


def test_word_error_rate_counts_substitutions_deletions_and_insertions():
    from levanter_model_whisper.transcribe import word_error_rate

    assert word_error_rate(["the cat sat"], ["the cat sat"]) == 0.0
    assert word_error_rate(["the cat sat"], ["the bat sat"]) == pytest.approx(1 / 3)
    assert word_error_rate(["the cat sat", "a dog"], ["the cat", "a big dog"]) == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="2 references but 1 hypotheses"):
        word_error_rate(["a", "b"], ["a"])
