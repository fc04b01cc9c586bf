"""``levanter eval`` of a Whisper goes through the ``asr`` objective: an audio manifest given with
``--data`` is scored by the loss and word error rate of its transcripts, counted in tokens and
words; on the validation set of the run that saved a checkpoint, the numbers equal what the run
logged at its last step; a manifest line whose audio is missing stops it with a message naming
the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from levanter_core.cli import main

pytest.importorskip("soundfile")

STEPS = 50  # enough to leave the random start: its eval WER (1.07 on this machine) is not a round number


def levanter_eval(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.fixture(scope="module")
def validation(tmp_path_factory):
    """4 synthesized sentences and their manifest (``validation/manifest.jsonl``)."""
    from levanter_audio.sentences import random_sentences
    from levanter_audio.synth import make_speech_corpus

    sentences = random_sentences(4, seed=1)
    manifest = make_speech_corpus(tmp_path_factory.mktemp("speech") / "validation", sentences, fmt="flac")
    return sentences, manifest


@pytest.fixture(scope="module")
def hf_whisper(tmp_path_factory):
    """A random tiny Hugging Face Whisper (a BPE tokenizer) with a 2-second window and room for
    64 transcript tokens (no sentence is cut)."""
    pytest.importorskip("transformers")
    from .conftest import tiny_hf_whisper

    return tiny_hf_whisper(
        str(tmp_path_factory.mktemp("hf-whisper")), max_source_positions=100, max_target_positions=64
    )


def test_eval_of_an_audio_manifest_reports_loss_and_wer_over_tokens_and_words(hf_whisper, validation):
    from levanter_audio.format import transcript_ids

    from levanter_core.data.tokenizer import load_tokenizer
    from levanter_core.evaluate import run_eval
    from levanter_model_whisper.objective import normalize_words

    sentences, manifest = validation
    report = run_eval(hf_whisper, data=[manifest], progress=False)  # what `levanter eval --data` prints
    found = report.as_json()
    entry = found["eval_sets"]["manifest"]
    # each transcript's tokens after its start token are scored, and its end-of-text token
    scored = sum(len(ids) for ids in transcript_ids(load_tokenizer(hf_whisper), sentences))
    words = sum(len(normalize_words(s)) for s in sentences)
    assert (entry["tokens"], entry["words"]) == (scored, words)
    assert set(entry) == {"loss", "wer", "tokens", "words"} and "bpb" not in found
    assert (found["loss"], found["wer"]) == (entry["loss"], entry["wer"])
    assert found["loss"] > 0 and found["wer"] > 0  # a random model transcribes nothing right
    header, _, row = report.table().splitlines()
    assert header.split() == ["set", "loss", "wer", "tokens", "words"]
    assert row.split() == ["manifest", f"{entry['loss']:.4f}", f"{entry['wer']:.4f}", str(scored), str(words)]


def test_a_manifest_line_whose_audio_is_missing_exits_2_naming_the_line(hf_whisper, validation, capsys):
    manifest = Path(validation[1])
    lines = manifest.read_text().splitlines()
    record = json.loads(lines[1])
    record["audio"] = "gone.flac"
    bad = manifest.with_name("bad.jsonl")  # beside the audio files the other lines name
    bad.write_text("\n".join([lines[0], json.dumps(record), *lines[2:]]) + "\n")
    code, _, err = levanter_eval(capsys, hf_whisper, "--data", str(bad))
    assert code == 2
    assert f"{bad}:2" in err and "gone.flac" in err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def trained(tmp_path_factory, validation):
    """A tiny Whisper trained ``STEPS`` steps by ``levanter train`` on 8 synthesized sentences,
    evaluated on the 4 of ``validation`` (one batch) after its last step."""
    from levanter_audio.sentences import random_sentences
    from levanter_audio.synth import make_speech_corpus

    tmp = tmp_path_factory.mktemp("asr-run")
    data = {
        "tokenizer": "byte",
        "train_urls": [make_speech_corpus(tmp / "train", random_sentences(8, seed=0), fmt="flac")],
        "validation_urls": [validation[1]],
        "cache_dir": str(tmp / "cache"),
    }
    config = {
        "data": data,
        "model": {"type": "whisper", "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
                  "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
                  "decoder_ffn_dim": 64, "num_mel_bins": 16, "max_source_positions": 100, "max_length": 48},
        "trainer": {"id": "asr", "seed": 0, "train_batch_size": 4, "num_train_steps": STEPS, "steps_per_eval": STEPS,
                    "max_eval_batches": None, "log_dir": str(tmp / "logs"), "tracker": {"type": "json"},
                    "checkpointer": {"base_path": str(tmp / "ckpt")}, "require_accelerator": False},
        "optimizer": {"learning_rate": 3e-3, "warmup": 0, "lr_schedule": "constant"},
    }  # fmt: skip
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(path)])
    assert exit_info.value.code == 0
    with open(tmp / "logs" / "asr" / "metrics.jsonl") as f:
        final = [m for m in map(json.loads, f) if "eval/loss" in m][-1]
    assert final["step"] == STEPS
    return {"config": str(path), "checkpoint": str(tmp / "ckpt" / "asr"), "final": final}


@pytest.mark.slow
def test_eval_of_a_whisper_checkpoint_gives_the_loss_and_wer_its_run_logged(trained, validation, capsys):
    code, out, err = levanter_eval(capsys, trained["checkpoint"], "--config", trained["config"], "--json")
    assert code == 0, err
    report = json.loads(out)
    final = trained["final"]
    # the same utterances, in one batch of four, with the weights the run evaluated last
    assert report["loss"] == pytest.approx(final["eval/loss"], rel=1e-5)
    assert report["wer"] == pytest.approx(final["eval/wer"], rel=1e-9)
    sentences = validation[0]
    # the byte tokenizer: each transcript's bytes and its end-of-text token are scored
    assert report["eval_sets"]["main"]["tokens"] == sum(len(s.encode()) + 1 for s in sentences)

    # the manifest given with --data reads the same, in batches of two as in one of four
    code, out, err = levanter_eval(
        capsys, trained["checkpoint"], "--data", validation[1], "--json", "--batch-size", "2"
    )
    assert code == 0, err
    by_file = json.loads(out)
    assert by_file["loss"] == pytest.approx(final["eval/loss"], rel=1e-5)
    assert by_file["wer"] == pytest.approx(final["eval/wer"], rel=1e-9)
    assert by_file["eval_sets"]["manifest"]["words"] == report["eval_sets"]["main"]["words"]
