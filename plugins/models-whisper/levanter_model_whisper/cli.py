"""``levanter transcribe SOURCE AUDIO...``: speech to text with a Whisper model, through the core's
generation engine (:func:`levanter_model_whisper.transcribe.transcribe_clips`).

Only ``typer`` and the core's CLI are imported here: the plugin registers the command for every
``levanter`` invocation, and JAX, the model and the audio libraries load when it runs."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer

from levanter_core.plugins.commands import SOURCE_HELP


def transcribe_command(
    source: Annotated[
        str,
        typer.Argument(help=SOURCE_HELP + " It must be a Whisper model (model type whisper).", metavar="SOURCE"),
    ],
    audio: Annotated[
        list[str],
        typer.Argument(
            help="Audio files to transcribe: WAV, FLAC, MP3, OGG and whatever else libsndfile reads, local "
            "paths or fsspec URLs (s3://, gs://, ...). Each is read as 16 kHz mono.",
            metavar="AUDIO",
        ),
    ],
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON object per file instead of its text: file, text, tokens (the token ids "
            "generated for all its windows, in order), seconds (of audio), windows, and language (the "
            "language token's code, when the prompt has one).",
        ),
    ] = False,
    batch_size: Annotated[
        int,
        typer.Option(
            help="Windows of audio decoded together: the generation engine's slots, each a row of its "
            "cache (more: faster on an accelerator, more memory).",
            min=1,
        ),
    ] = 16,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            help="Most tokens generated per window; a window ends sooner at the end-of-text token "
            "[default: all the decoder's positions after the prompt, 448 in all for Whisper].",
            min=1,
        ),
    ] = None,
    prompt_ids: Annotated[
        str | None,
        typer.Option(
            help="The tokens the decoder starts each window with, as comma-separated ids (e.g. "
            "50258,50259,50359,50363), instead of the model's own. By default a Hugging Face Whisper "
            "starts with its decoder_start_token_id and what its generation config forces (language, "
            "task, no timestamps); a model trained here with the tokens its data format puts before a "
            "transcript.",
            metavar="ID,ID,...",
        ),
    ] = None,
    language: Annotated[
        str | None,
        typer.Option(
            help="The language spoken, as the code of its token (en, fr, de, ...), for a multilingual "
            "Hugging Face Whisper [default: its generation config's; else the model names it, on each "
            "file's first window].",
        ),
    ] = None,
    task: Annotated[
        str | None,
        typer.Option(
            help="transcribe, or translate (into English), for a multilingual Hugging Face Whisper "
            "[default: its generation config's, else transcribe].",
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="Tokenizer to use instead of SOURCE's own: a tokenizer.json, its directory, or a hub name."),
    ] = None,
    progress: Annotated[
        bool | None,
        typer.Option(
            "--progress/--no-progress",
            help="Show a progress bar on stderr [default: with several files, when stderr is a terminal].",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Transcribe audio files with a Whisper model: one line of text per file, in order.

    Audio longer than the model's window (30 s for Whisper) is cut into consecutive windows,
    each transcribed on its own; their texts are joined with a space. A shorter file, or the
    last window, is padded with silence, as Whisper pads it. Every window is decoded greedily
    through the generation engine, many at once (--batch-size), until the end-of-text token or
    --max-new-tokens. The text leaves out special tokens.
    """
    shown = progress if progress is not None else (len(audio) > 1 and sys.stderr.isatty())
    run_transcribe(
        source,
        audio,
        as_json=as_json,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        prompt_ids=prompt_ids,
        language=language,
        task=task,
        tokenizer=tokenizer,
        progress=shown,
    )


def run_transcribe(
    source: str,
    files: list[str],
    *,
    as_json: bool = False,
    batch_size: int = 16,
    max_new_tokens: int | None = None,
    prompt_ids: str | None = None,
    language: str | None = None,
    task: str | None = None,
    tokenizer: str | None = None,
    progress: bool = False,
    out=print,
) -> None:
    """What ``levanter transcribe`` does: print the transcript of each of ``files``."""
    from levanter_audio.io import load_audio
    from tqdm.auto import tqdm

    from levanter_core.errors import UserError
    from levanter_core.inference.engine import Engine
    from levanter_core.models.source import load_model_source
    from levanter_model_whisper.transcribe import SpecialTokens, transcribe_clips
    from levanter_model_whisper.whisper import WhisperModel

    _refuse_other_hf_models(source)
    loaded = load_model_source(source, tokenizer=tokenizer)
    if not isinstance(loaded.model, WhisperModel):
        raise UserError(
            f"{source} is not a Whisper model (its model type is {loaded.config.type!r}): levanter transcribe "
            "needs a speech-recognition model of type whisper"
        )
    if loaded.tokenizer is None:
        raise UserError(f"{source} has no tokenizer (no tokenizer.json); name one with --tokenizer")
    special = SpecialTokens.of(loaded.tokenizer)
    prompt = _prompt(loaded, special, prompt_ids, language, task)
    room = loaded.config.seq_len - prompt.longest
    if room < 1:
        raise UserError(f"the prompt has {prompt.longest} tokens, and the decoder reads {loaded.config.seq_len} in all")
    if max_new_tokens is not None and max_new_tokens > room:
        raise UserError(
            f"--max-new-tokens {max_new_tokens}: after the prompt's {prompt.longest} tokens the decoder has "
            f"{room} positions left (seq_len {loaded.config.seq_len}); ask for at most {room}"
        )
    new_tokens = max_new_tokens or room
    languages = {i: t[2:-2] for t, i in special.ids.items()}

    engine = Engine(
        loaded.model,
        eos_ids=loaded.eos_ids,
        max_seqs=batch_size,
        max_seq_len=prompt.longest + new_tokens,
        max_rounds=8,
        max_prefill_seqs=batch_size,
    ).start()

    def clips():
        for path in files:
            yield load_audio(path)

    bar = tqdm(total=len(files), unit="file", desc="transcribe", file=sys.stderr, disable=not progress)
    show = tqdm.write if progress else out
    finished = False
    try:
        results = transcribe_clips(
            engine,
            clips(),
            prompt=prompt,
            max_new_tokens=new_tokens,
            text=lambda ids: special.text(loaded.tokenizer, ids),
        )
        for path, transcript in zip(files, results):
            text = " ".join(transcript.text.split("\n"))
            if as_json:
                record = {
                    "file": path,
                    "text": text,
                    "tokens": transcript.tokens,
                    "seconds": round(transcript.seconds, 3),
                    "windows": transcript.windows,
                }
                if transcript.language is not None:
                    record["language"] = languages.get(transcript.language)
                show(json.dumps(record, ensure_ascii=False))
            else:
                show(text)
            bar.update()
        finished = True
    finally:
        bar.close()
        engine.shutdown(drain=finished)  # after a bad file, stop at once rather than finish the others


def _refuse_other_hf_models(source: str) -> None:
    """Refuse a Hugging Face directory of another model type before loading its weights."""
    from levanter_core.errors import UserError

    config = os.path.join(source, "config.json")
    if not os.path.isfile(config):
        return
    try:
        with open(config) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError):
        return  # loading it says what is wrong
    if model_type is not None and model_type != "whisper":
        raise UserError(
            f"{source} is not a Whisper model (its config.json has model_type {model_type!r}): levanter "
            "transcribe needs a speech-recognition model of type whisper"
        )


def _prompt(loaded, special, prompt_ids: str | None, language: str | None, task: str | None):
    """The decoder's first tokens: ``--prompt-ids``; a Hugging Face Whisper's (its configs'); or,
    for a model trained here, what its data format puts before a transcript."""
    from levanter_core.errors import UserError
    from levanter_model_whisper.transcribe import DecoderPrompt, decoder_prompt

    vocab = loaded.Vocab.size
    if prompt_ids is not None:
        if language is not None or task is not None:
            raise UserError("--language and --task make the prompt; with --prompt-ids, give all of it there")
        try:
            ids = [int(part) for part in prompt_ids.split(",")]
        except ValueError:
            raise UserError(f"--prompt-ids {prompt_ids!r}: expected token ids separated by commas, e.g. 1,2") from None
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise UserError(f"--prompt-ids: token {bad[0]} is outside the model's vocabulary (0 to {vocab - 1})")
        return DecoderPrompt(tuple(ids))
    if "decoder_start_token_id" in loaded.hf_config or "decoder_start_token_id" in loaded.generation_config:
        prompt = decoder_prompt(loaded.hf_config, loaded.generation_config, special, language=language, task=task)
        bad = [t for t in prompt.tokens if not 0 <= t < vocab]
        if bad:
            raise UserError(
                f"{loaded.source}: the prompt its config sets has token {bad[0]}, outside the vocabulary "
                f"(0 to {vocab - 1}): give the prompt with --prompt-ids"
            )
        return prompt
    if language is not None or task is not None:
        raise UserError(
            f"--language and --task choose a Hugging Face Whisper's special tokens; {loaded.source} has no Hugging "
            "Face generation settings (a model trained here starts with its data format's prompt): give "
            "--prompt-ids instead"
        )
    try:
        from levanter_audio.format import transcript_prompt
    except ImportError:
        raise UserError(
            f"{loaded.source} has no Hugging Face generation settings, and this levanter-audio cannot say which "
            "tokens its data format puts before a transcript: give the prompt with --prompt-ids"
        ) from None
    ids = list(transcript_prompt(loaded.tokenizer, enforce_bos=_enforce_bos(loaded.run_config)))
    if not ids:
        raise UserError(
            f"{loaded.source}: its tokenizer puts no token before a transcript, and the decoder needs one to "
            "start from: give the prompt with --prompt-ids"
        )
    return DecoderPrompt(tuple(ids))


def _enforce_bos(run_config: dict) -> bool:
    """Whether the run's data format started each transcript with a start token (``enforce_bos``
    of every source's ``format``; true unless one says otherwise)."""
    data = run_config.get("data") or {}
    sources = list((data.get("configs") or {}).values()) or [data]
    return all(((source or {}).get("format") or {}).get("enforce_bos", True) for source in sources)
