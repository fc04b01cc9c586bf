"""Transcription through the core's generation engine and ``levanter transcribe``: the engine
decodes what ``greedy_transcribe`` does, token for token, with more clips than slots; long
audio is cut into 30-second windows; the decoder's prompt follows a Hugging Face Whisper's
configs; the command prints a line (or a JSON object) per file and refuses, with exit status 2
and the culprit's name, a file that is not audio and a model that is not Whisper."""

from __future__ import annotations

import json

import numpy as np
import pytest

from levanter_core.errors import UserError

transformers = pytest.importorskip("transformers")
soundfile = pytest.importorskip("soundfile")

WINDOW = 480_000  # samples in the tiny model's window: 30 s, Whisper's


@pytest.fixture(scope="module")
def loaded(whisper_dir):
    from levanter_core.models.source import load_model_source

    return load_model_source(whisper_dir)


def _engine(loaded, *, slots: int, max_new_tokens: int, prompt_len: int = 2):
    from levanter_core.inference.engine import Engine

    return Engine(
        loaded.model, eos_ids=loaded.eos_ids, max_seqs=slots, max_rounds=3, max_seq_len=prompt_len + max_new_tokens
    )


def _prompt(loaded):
    from levanter_model_whisper.transcribe import DecoderPrompt, SpecialTokens, decoder_prompt

    prompt = decoder_prompt(loaded.hf_config, loaded.generation_config, SpecialTokens.of(loaded.tokenizer))
    assert isinstance(prompt, DecoderPrompt) and len(prompt.tokens) == 2  # <|startoftranscript|> <|notimestamps|>
    return prompt


def _transcribe(loaded, clips, *, slots=2, max_new_tokens=8):
    from levanter_model_whisper.transcribe import SpecialTokens, transcribe_clips

    special = SpecialTokens.of(loaded.tokenizer)
    with _engine(loaded, slots=slots, max_new_tokens=max_new_tokens) as engine:
        return list(
            transcribe_clips(
                engine,
                clips,
                prompt=_prompt(loaded),
                max_new_tokens=max_new_tokens,
                text=lambda ids: special.text(loaded.tokenizer, ids),
            )
        )


def test_the_engine_transcribes_as_greedy_transcribe(loaded, speech):
    """Clips of 0.4 to 4 s and one of 35 s (two windows), five clips and six windows through two
    slots: each window's tokens are those of the standalone greedy loop over all windows at once."""
    from levanter_model_whisper.transcribe import greedy_transcribe, window_features

    clips = [*speech[:4], np.concatenate([speech[4], np.zeros(35 * 16_000 - len(speech[4]), np.float32), speech[1]])]
    transcripts = _transcribe(loaded, clips, slots=2, max_new_tokens=8)

    windows = [list(window_features(c, num_mels=8, num_frames=3000)) for c in clips]
    assert [len(w) for w in windows] == [1, 1, 1, 1, 2]
    (end,) = loaded.eos_ids
    expected = greedy_transcribe(
        loaded.model, np.stack([f for w in windows for f in w]), prompt=_prompt(loaded).tokens, end_id=end, max_tokens=8
    )
    got = [t.tokens for t in transcripts]
    assert got == [*expected[:4], expected[4] + expected[5]]
    assert len({tuple(t) for t in got}) > 1  # the transcripts depend on the audio
    assert [t.windows for t in transcripts] == [1, 1, 1, 1, 2]
    assert transcripts[4].seconds == pytest.approx(35 + len(speech[1]) / 16_000)


def test_long_audio_is_cut_into_30_second_windows(loaded, speech):
    """70 s of sentences and silence: three windows (30 s, 30 s and 10 s, padded), whose texts,
    joined with a space, are the transcripts of the three pieces given as clips of their own."""
    pause = np.zeros(16_000, np.float32)
    pieces, length = [], 0
    while length < 70 * 16_000:
        for sentence in speech:
            pieces += [sentence, pause]
            length += len(sentence) + len(pause)
    clip = np.concatenate(pieces)[: 70 * 16_000]

    whole, *separately = _transcribe(loaded, [clip, clip[:WINDOW], clip[WINDOW : 2 * WINDOW], clip[2 * WINDOW :]])
    assert whole.windows == 3 and whole.seconds == 70.0
    assert [s.windows for s in separately] == [1, 1, 1]
    assert whole.tokens == [t for s in separately for t in s.tokens]
    assert whole.text == " ".join(s.text for s in separately if s.text)


def test_the_engine_refuses_a_request_without_its_spectrogram(loaded):
    from levanter_core.inference.engine import RequestError
    from levanter_core.inference.sampling import SamplingParams

    engine = _engine(loaded, slots=1, max_new_tokens=4)
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    needs = r"model type 'whisper' is an encoder-decoder: each request needs an encoder input \(mels=8, frames=3000\)"
    with pytest.raises(RequestError, match=needs) as e:
        engine.check([1], params)
    assert e.value.status == 400 and e.value.field == "encoder_input"
    shape = r"the encoder input has shape \(8, 200\); model type 'whisper' takes \(mels=8, frames=3000\)"
    with pytest.raises(RequestError, match=shape):
        engine.check([1], params, np.zeros((8, 200), np.float32))


# -- the prompt ----------------------------------------------------------------------------------------
def _special():
    from levanter_model_whisper.transcribe import SpecialTokens

    from .conftest import SPECIAL_TOKENS

    ids = {t: 90 + i for i, t in enumerate(SPECIAL_TOKENS)}  # <|startoftranscript|> 91, <|en|> 92, <|fr|> 93, ...
    return SpecialTokens(ids, frozenset(ids.values()))


START, EN, FR, TRANSLATE, TRANSCRIBE, NO_TIMESTAMPS = 91, 92, 93, 94, 95, 96


def test_the_prompt_of_a_hugging_face_whisper():
    from levanter_model_whisper.transcribe import decoder_prompt

    special = _special()
    config = {"decoder_start_token_id": START}
    # no generation settings: the start token and, where the tokenizer has it, <|notimestamps|>
    assert decoder_prompt(config, {}, special).tokens == (START, NO_TIMESTAMPS)
    # an older config.json forces the language, task and no timestamps (openai/whisper-tiny's)
    forced = {**config, "forced_decoder_ids": [[1, EN], [2, TRANSCRIBE], [3, NO_TIMESTAMPS]]}
    prompt = decoder_prompt(forced, {}, special)
    assert (prompt.tokens, prompt.language, prompt.detect_at) == ((START, EN, TRANSCRIBE, NO_TIMESTAMPS), EN, None)
    assert decoder_prompt(forced, {}, special, language="fr", task="translate").tokens == (
        START,
        FR,
        TRANSLATE,
        NO_TIMESTAMPS,
    )
    # an English-only model forces no timestamps alone
    english = {**config, "forced_decoder_ids": [[1, NO_TIMESTAMPS]]}
    assert decoder_prompt(english, {}, special).tokens == (START, NO_TIMESTAMPS)

    # a multilingual generation config that leaves the language to the model
    generation = {
        "decoder_start_token_id": START, "forced_decoder_ids": [[1, None], [2, TRANSCRIBE]], "is_multilingual": True,
        "lang_to_id": {"<|en|>": EN, "<|fr|>": FR}, "task_to_id": {"translate": TRANSLATE, "transcribe": TRANSCRIBE},
        "no_timestamps_token_id": NO_TIMESTAMPS,
    }  # fmt: skip
    detect = decoder_prompt(forced, generation, special)  # generation_config.json wins over config.json
    assert (detect.tokens, detect.detect_at, detect.languages) == ((START, TRANSCRIBE, NO_TIMESTAMPS), 1, {EN, FR})
    assert detect.with_language(FR) == [START, FR, TRANSCRIBE, NO_TIMESTAMPS] and detect.longest == 4
    assert decoder_prompt(forced, generation, special, language="en").tokens == (START, EN, TRANSCRIBE, NO_TIMESTAMPS)
    assert decoder_prompt(forced, {**generation, "language": "<|fr|>"}, special).tokens == (
        START,
        FR,
        TRANSCRIBE,
        NO_TIMESTAMPS,
    )
    # without forced ids, a multilingual model is told to transcribe
    free = {k: v for k, v in generation.items() if k != "forced_decoder_ids"}
    assert decoder_prompt({}, free, special, language="en").tokens == (START, EN, TRANSCRIBE, NO_TIMESTAMPS)

    with pytest.raises(
        UserError, match=r"language 'de': the model's tokenizer has no <\|de\|> token \(languages: en, fr\)"
    ):
        decoder_prompt(forced, {}, special, language="de")
    with pytest.raises(
        UserError, match=r"task 'summarize': the model has no such task \(tasks: transcribe, translate\)"
    ):
        decoder_prompt(forced, {}, special, task="summarize")
    with pytest.raises(UserError, match="sets no decoder_start_token_id: give the prompt with --prompt-ids"):
        decoder_prompt({}, {}, special)


def test_transcripts_leave_special_tokens_out(loaded):
    from levanter_model_whisper.transcribe import SpecialTokens

    special = SpecialTokens.of(loaded.tokenizer)
    ids = loaded.tokenizer.encode_batch(["<|en|>the cat<|endoftext|>"])[0].tolist()
    assert special.ids["<|en|>"] in ids and special.text(loaded.tokenizer, ids) == "the cat"


# -- levanter transcribe ----------------------------------------------------------------------------
def _run(args, capsys) -> tuple[int, str, str]:
    from levanter_core.cli import main

    capsys.readouterr()  # what came before (building models) is not the command's
    with pytest.raises(SystemExit) as exited:
        main(["transcribe", *args])
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.fixture(scope="module")
def audio_files(speech, tmp_path_factory):
    directory = tmp_path_factory.mktemp("audio")
    files = []
    for i, clip in enumerate(speech[:3]):
        path = directory / f"{i}.{'flac' if i == 1 else 'wav'}"
        soundfile.write(path, clip, 16_000)
        files.append(str(path))
    return files


def test_the_command_prints_a_transcript_per_file(whisper_dir, audio_files, speech, loaded, capsys):
    options = ["--max-new-tokens", "6", "--batch-size", "2"]
    code, out, err = _run([whisper_dir, *audio_files, *options], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 3

    code, out, err = _run([whisper_dir, *audio_files, *options, "--json"], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["file"] for r in records] == audio_files
    assert [r["text"] for r in records] == lines
    assert [r["seconds"] for r in records] == [round(len(s) / 16_000, 3) for s in speech[:3]]
    assert all(r["windows"] == 1 and 1 <= len(r["tokens"]) <= 6 for r in records)
    # the tokens are the engine's transcription of the files' audio
    expected = _transcribe(loaded, speech[:3], max_new_tokens=6)
    assert [r["tokens"] for r in records] == [t.tokens for t in expected]

    # the same prompt, given explicitly
    prompt = ",".join(map(str, _prompt(loaded).tokens))
    code, out, err = _run([whisper_dir, *audio_files, *options, "--json", "--prompt-ids", prompt], capsys)
    assert code == 0, err
    assert [json.loads(line)["tokens"] for line in out.splitlines()] == [r["tokens"] for r in records]


def test_a_file_that_is_not_audio_exits_2_naming_it(whisper_dir, audio_files, tmp_path, capsys):
    notes = tmp_path / "notes.wav"
    notes.write_text("these are not the sounds you are looking for\n")
    code, _out, err = _run([whisper_dir, audio_files[0], str(notes), "--max-new-tokens", "2"], capsys)
    assert code == 2
    assert f"error: {notes}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_source_that_is_not_whisper_exits_2_naming_it(audio_files, tmp_path, capsys):
    from levanter_core.testing import tiny_hf_llama

    llama = tiny_hf_llama(str(tmp_path / "llama"), ["some text to train a tokenizer on"] * 8, vocab_size=300)
    code, out, err = _run([llama, audio_files[0]], capsys)
    assert code == 2 and out == ""
    assert err.strip() == (
        f"error: {llama} is not a Whisper model (its config.json has model_type 'llama'): levanter transcribe "
        "needs a speech-recognition model of type whisper"
    )


def test_bad_options_exit_2(whisper_dir, audio_files, capsys):
    for args, message in [
        (["--prompt-ids", "1,x"], "--prompt-ids '1,x': expected token ids separated by commas"),
        (["--prompt-ids", "1,5000"], "--prompt-ids: token 5000 is outside the model's vocabulary (0 to 299)"),
        (["--max-new-tokens", "31"], "--max-new-tokens 31: after the prompt's 2 tokens the decoder has 30 positions left"),
        (["--language", "de"], "language 'de': the model's tokenizer has no <|de|> token (languages: en, fr)"),
        (["--prompt-ids", "1", "--task", "translate"], "--language and --task make the prompt; with --prompt-ids"),
    ]:  # fmt: skip
        code, _, err = _run([whisper_dir, audio_files[0], *args], capsys)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)


def test_a_multilingual_whisper_is_told_or_names_the_language(tmp_path, audio_files, speech, capsys):
    """With ``--language fr`` every window starts ``<|startoftranscript|> <|fr|> <|transcribe|>
    <|notimestamps|>``; without it, the model's own choice after the start token on the first
    window (when a language token) goes there."""
    from levanter_core.models.source import load_model_source
    from levanter_model_whisper.tests.conftest import tiny_hf_whisper
    from levanter_model_whisper.transcribe import greedy_transcribe, window_features

    generation = {
        "decoder_start_token_id": "<|startoftranscript|>", "eos_token_id": "<|endoftext|>",
        "forced_decoder_ids": [[1, None], [2, "<|transcribe|>"]], "is_multilingual": True,
        "lang_to_id": {"<|en|>": "<|en|>", "<|fr|>": "<|fr|>"},
        "task_to_id": {"transcribe": "<|transcribe|>", "translate": "<|translate|>"},
        "no_timestamps_token_id": "<|notimestamps|>",
    }  # fmt: skip
    directory = tiny_hf_whisper(str(tmp_path / "multilingual"), generation_config=generation, seed=1)
    code, out, err = _run([directory, audio_files[0], "--max-new-tokens", "3", "--json", "--language", "fr"], capsys)
    assert code == 0, err
    assert json.loads(out)["language"] == "fr"

    code, out, err = _run([directory, audio_files[0], "--max-new-tokens", "3", "--json"], capsys)
    assert code == 0, err
    model = load_model_source(directory)
    ids = model.tokenizer.encode_batch(["<|startoftranscript|><|en|><|fr|>"])[0].tolist()
    (chosen,) = greedy_transcribe(
        model.model,
        next(window_features(speech[0], num_mels=8, num_frames=3000))[None],
        prompt=ids[:1],
        end_id=-1,
        max_tokens=1,
    )
    named = {ids[1]: "en", ids[2]: "fr"}.get(chosen[0])
    assert json.loads(out).get("language") == named


def test_a_model_trained_here_starts_with_its_data_formats_prompt(tmp_path, speech, capsys):
    """A checkpoint of a run on byte-level transcripts (no Hugging Face config): each window
    starts with what ``levanter_audio.format.transcript_prompt`` says (``<|endoftext|>``, 256),
    and the encoder's window is the model's own (2 s here: a 3.4 s clip is two windows)."""
    import jax
    from haliax import Axis

    from levanter_core.checkpoint import write_checkpoint
    from levanter_model_whisper.transcribe import greedy_transcribe, window_features
    from levanter_model_whisper.whisper import WhisperConfig

    config = WhisperConfig(
        d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, decoder_layers=1,
        decoder_attention_heads=2, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=100, seq_len=12,
        initializer_range=0.5,
    )  # fmt: skip
    model = config.build(Axis("vocab", 257), key=jax.random.PRNGKey(3))
    run = {"model": config.model_dump(mode="json"), "data": {"tokenizer": "byte", "format": {"type": "audio"}}}
    write_checkpoint(
        {"model": model}, str(tmp_path / "run" / "step-5"), step=5, metadata={"config": run, "vocab_size": 257}
    )
    clip = tmp_path / "clip.wav"
    soundfile.write(clip, speech[2], 16_000)

    code, out, err = _run([str(tmp_path / "run"), str(clip), "--json", "--max-new-tokens", "6"], capsys)
    assert code == 0, err
    record = json.loads(out)
    windows = list(window_features(speech[2], num_mels=8, num_frames=200))
    assert record["windows"] == len(windows) == 2
    expected = greedy_transcribe(model, np.stack(windows), prompt=[256], end_id=256, max_tokens=6)
    assert record["tokens"] == expected[0] + expected[1]


def test_help_explains_every_option(capsys):
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    for option in ("--batch-size", "--max-new-tokens", "--prompt-ids", "--language", "--task", "--json", "--tokenizer"):
        assert option in out
    words = " ".join(out.split())
    assert "(30 s for Whisper) is cut into consecutive windows" in words and "joined with a space" in words
