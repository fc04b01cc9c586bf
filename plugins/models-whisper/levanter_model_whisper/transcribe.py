"""Transcription with a Whisper model, and word error rate.

:func:`transcribe_clips` transcribes any number of audio clips through the core's generation
engine (:class:`~levanter_core.inference.engine.Engine`, which serves Whisper as an
encoder-decoder): each clip is cut into the model's windows (30 s for Whisper), each window
is one request (its spectrogram and the decoder's prompt), the engine decodes them greedily in
its slots, many at once, and each clip's windows' texts are joined. ``levanter transcribe``
runs it. :func:`decoder_prompt` finds the tokens the decoder starts with.

:func:`greedy_transcribe` decodes one batch on its own, in one compiled program (the ``asr``
objective's :func:`~levanter_model_whisper.objective.greedy_tokens`, which evaluation uses): it
encodes the spectrograms once, feeds the decoder its prompt tokens, then one token per step (the
most likely one) through the cross-attention cache, ``max_tokens`` steps; each row's tokens end
before its first end token.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jiwer
import numpy as np
from haliax import Axis
from levanter_audio.features import HOP_LENGTH, log_mel_spectrogram_jax, pad_or_trim

from levanter_core.errors import UserError
from levanter_core.inference.engine import RequestError
from levanter_core.inference.sampling import SamplingParams
from levanter_model_whisper.objective import greedy_tokens

logger = logging.getLogger(__name__)


def greedy_transcribe(
    model, features: np.ndarray, *, prompt: Sequence[int], end_id: int, max_tokens: int
) -> list[list[int]]:
    """For each row of ``features`` (log-mel spectrograms ``[rows, mels, frames]``), the token
    ids the model reads after ``prompt`` (greedy), without the end token ``end_id``, at most
    ``max_tokens`` of them."""
    if not prompt:
        raise ValueError("the decoder needs at least one prompt token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    config = model.config
    total = len(prompt) + max_tokens
    if total > config.seq_len:
        raise ValueError(
            f"{len(prompt)} prompt tokens and {max_tokens} new ones exceed the decoder's {config.seq_len} positions"
        )
    Batch = Axis("batch", features.shape[0])
    spectrograms = hax.named(jnp.asarray(features, jnp.float32), (Batch, config.Mels.name, config.Frames.name))
    chosen = np.asarray(_greedy_tokens(model, spectrograms, tuple(prompt), max_tokens)).tolist()
    return [ids[: ids.index(end_id)] if end_id in ids else ids for ids in chosen]


_greedy_tokens = eqx.filter_jit(greedy_tokens)


# -- transcribing clips through the generation engine ---------------------------------------------
@dataclass
class Transcript:
    """One clip's transcription."""

    text: str
    """Each window's text (special tokens left out), stripped, joined with a space."""
    tokens: list[int]
    """The token ids generated for every window, in order (no prompt, no end token)."""
    windows: int
    """How many windows the clip was cut into."""
    seconds: float
    """The clip's length (16 kHz samples / 16,000)."""
    language: int | None = None
    """The language token the windows were decoded with (None: the prompt has none)."""


def window_features(audio: np.ndarray, *, num_mels: int, num_frames: int) -> Iterator[np.ndarray]:
    """Whisper's log-mel features ``[num_mels, num_frames]`` (float32) of each consecutive window
    of ``audio`` (16 kHz mono), one after the other: a window is ``num_frames`` frames of 160
    samples (30 s for 3,000), the last one padded with silence as Whisper pads a short clip. They
    are computed as the ``asr`` objective computes them in training (``log_mel_spectrogram_jax``
    of the window's samples), so that a model trained here with a shorter window hears what it
    learned from."""
    window = num_frames * HOP_LENGTH
    spectrogram = _log_mel(num_mels)
    for start in range(0, max(len(audio), 1), window):
        yield np.asarray(spectrogram(pad_or_trim(audio[start : start + window], window)))


@functools.cache
def _log_mel(num_mels: int):
    return jax.jit(functools.partial(log_mel_spectrogram_jax, n_mels=num_mels))


def transcribe_clips(
    engine,
    clips: Iterable[np.ndarray],
    *,
    prompt: DecoderPrompt,
    max_new_tokens: int,
    text: Callable[[list[int]], str],
    in_flight: int | None = None,
) -> Iterator[Transcript]:
    """Transcribe each of ``clips`` (16 kHz mono audio, read lazily, in order) with ``engine``
    (an :class:`~levanter_core.inference.engine.Engine` serving a Whisper model, with its
    end-of-text token among its ``eos_ids``), greedily; yield their transcripts in order.

    Each clip is cut into the model's windows (:func:`window_features`), each window a request
    of at most ``max_new_tokens`` tokens after ``prompt``; ``text`` turns a window's tokens into
    its text. At most ``in_flight`` windows (default: twice the engine's slots) wait or decode
    at once, so that the engine always has work and a long list of files is never all in memory."""
    axes = engine.encoder_input_axes
    if axes is None or [ax.name for ax in axes] != ["mels", "frames"]:
        raise ValueError("the engine does not serve a Whisper model (its requests take no spectrogram)")
    num_mels, num_frames = (ax.size for ax in axes)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    in_flight = in_flight or 2 * engine.max_seqs
    unfinished: collections.deque = collections.deque()  # every request not yet waited on, oldest first
    pending: collections.deque = collections.deque()  # clips whose transcripts are not yet given out

    def ready():  # the oldest clips whose windows have all been submitted and decoded
        while pending and pending[0]["complete"] and all(r.done() for r in pending[0]["requests"]):
            yield _transcript(pending.popleft(), text)

    for audio in clips:
        windows = window_features(audio, num_mels=num_mels, num_frames=num_frames)  # computed as submitted
        language = prompt.language
        if prompt.detect_at is not None:
            first = next(windows)
            language = _detect_language(engine, prompt, first)
            windows = itertools.chain([first], windows)
        ids = prompt.with_language(language)
        clip = {"requests": [], "seconds": len(audio) / 16_000, "language": language, "complete": False}
        pending.append(clip)
        for features in windows:
            while len(unfinished) >= in_flight:
                unfinished.popleft().result()
                yield from ready()
            request = _submit(engine, ids, params, features)
            clip["requests"].append(request)
            unfinished.append(request)
        clip["complete"] = True
        yield from ready()
    while pending:
        yield _transcript(pending.popleft(), text)


def _submit(engine, prompt: list[int], params, features: np.ndarray):
    while True:  # a full queue (a very long clip) waits for room rather than fails
        try:
            return engine.submit(prompt, params, encoder_input=features)
        except RequestError as e:
            if e.status != 429:
                raise UserError(str(e)) from None
            time.sleep(0.01)


def _detect_language(engine, prompt: DecoderPrompt, features: np.ndarray) -> int | None:
    """The language token the model chooses after the prompt's first tokens, on a clip's first
    window (as Whisper detects the language), when it is one of the prompt's languages."""
    first = prompt.tokens[: prompt.detect_at]
    chosen = _submit(engine, list(first), SamplingParams(max_new_tokens=1, temperature=0.0), features).result().tokens
    if chosen and chosen[0] in prompt.languages:
        return chosen[0]
    logger.warning("the model named no language (it chose %s): decoding without a language token", chosen)
    return None


def _transcript(clip: dict, text: Callable[[list[int]], str]) -> Transcript:
    tokens, texts = [], []
    for request in clip["requests"]:
        ids = request.result().tokens
        tokens.extend(ids)
        texts.append(text(ids).strip())
    joined = " ".join(t for t in texts if t)
    return Transcript(joined, tokens, len(clip["requests"]), clip["seconds"], clip["language"])


# -- the decoder's prompt -----------------------------------------------------------------------------
_LANGUAGE_TOKEN = re.compile(r"^<\|([a-z]{2,3})\|>$")
NO_TIMESTAMPS = "<|notimestamps|>"


@dataclass(frozen=True)
class SpecialTokens:
    """A tokenizer's added tokens: ``ids`` by their text, and the ids of those marked special,
    which a transcript's text leaves out."""

    ids: dict[str, int]
    special: frozenset[int]

    @staticmethod
    def of(tokenizer) -> SpecialTokens:
        if tokenizer is None:
            return SpecialTokens({}, frozenset())
        added = json.loads(tokenizer.to_tokenizer_json()).get("added_tokens") or []
        return SpecialTokens(
            {t["content"]: int(t["id"]) for t in added}, frozenset(int(t["id"]) for t in added if t.get("special"))
        )

    def languages(self) -> dict[str, int]:
        """Whisper's language tokens (``<|en|>``, ``<|haw|>``...) by their text."""
        return {t: i for t, i in self.ids.items() if i in self.special and _LANGUAGE_TOKEN.match(t)}

    def text(self, tokenizer, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out."""
        return tokenizer.decode([t for t in ids if t not in self.special])


@dataclass(frozen=True)
class DecoderPrompt:
    """The tokens the decoder starts each window with."""

    tokens: tuple[int, ...]
    """The first tokens (without the language's, where the model is to name it)."""
    language: int | None = None
    """The language token among ``tokens`` (None: none, or the model names it)."""
    detect_at: int | None = None
    """Where the model's own language token goes, when it is to name it (a multilingual model
    told no language): it reads ``tokens[:detect_at]`` of a clip's first window and chooses the
    next token, which goes there when it is one of ``languages``. None: ``tokens`` as they are."""
    languages: frozenset[int] = frozenset()

    def with_language(self, language: int | None) -> list[int]:
        """The prompt with ``language`` (the model's choice) put in where it goes."""
        if self.detect_at is None or language is None:
            return list(self.tokens)
        return [*self.tokens[: self.detect_at], language, *self.tokens[self.detect_at :]]

    @property
    def longest(self) -> int:
        """The most tokens the prompt may have (with a detected language)."""
        return len(self.tokens) + (self.detect_at is not None)


def decoder_prompt(
    hf_config: dict,
    generation_config: dict,
    tokens: SpecialTokens,
    *,
    language: str | None = None,
    task: str | None = None,
) -> DecoderPrompt:
    """The decoder's first tokens for a Whisper from Hugging Face, as ``transformers``' Whisper
    ``generate`` makes them: ``decoder_start_token_id``, then what ``forced_decoder_ids`` force at
    positions 1, 2, ... (``generation_config.json``'s settings where the model has one, else
    ``config.json``'s); a multilingual model's language (``language``: a code such as ``en``, or
    the configured one; without either, the model names it: see :class:`DecoderPrompt`) and task
    (``task``: ``transcribe`` or ``translate``, default transcribe); and ``<|notimestamps|>``
    (``no_timestamps_token_id``). Language and task tokens come from the config's ``lang_to_id``
    and ``task_to_id``, else from the tokenizer (``<|en|>``, ``<|transcribe|>``); a setting whose
    token neither has is skipped, a ``language`` or ``task`` asked for and not found refused."""
    settings = generation_config or hf_config
    start = settings.get("decoder_start_token_id", hf_config.get("decoder_start_token_id"))
    if start is None:
        raise UserError("the model's config sets no decoder_start_token_id: give the prompt with --prompt-ids")
    init: list[int | None] = [int(start)]
    forced = sorted((int(p), i) for p, i in (settings.get("forced_decoder_ids") or []))
    for position, token in forced:
        if position != len(init):
            break
        init.append(None if token is None else int(token))

    languages = {k: int(v) for k, v in (settings.get("lang_to_id") or {}).items()} or tokens.languages()
    language_ids = set(languages.values())
    tasks = {k: int(v) for k, v in (settings.get("task_to_id") or {}).items()}
    if not tasks:
        named = {name: f"<|{name}|>" for name in ("transcribe", "translate")}
        tasks = {name: tokens.ids[text] for name, text in named.items() if text in tokens.ids}
    undefined = len(init) <= 1 or init[1] is None
    multilingual = settings.get("is_multilingual")
    if multilingual is None:
        multilingual = "lang_to_id" in settings or (len(init) > 1 and (init[1] is None or init[1] in language_ids))

    detect = False
    wanted = language or (settings.get("language") if undefined else None)
    if wanted is not None:
        key = wanted if wanted.startswith("<|") else f"<|{wanted}|>"
        if key not in languages:
            known = ", ".join(sorted(k[2:-2] for k in languages)[:12]) or "none"
            raise UserError(f"language {wanted!r}: the model's tokenizer has no {key} token (languages: {known})")
        init[1:2] = [languages[key]]  # position 1 is the language's (as transformers puts it)
    elif multilingual and undefined and language_ids:
        detect = True
        if len(init) == 1:
            init.append(None)

    if task is not None:
        if task not in tasks:
            raise UserError(f"task {task!r}: the model has no such task (tasks: {', '.join(sorted(tasks)) or 'none'})")
        _replace_or_add(init, tasks[task], tasks.values())
    elif multilingual and "transcribe" in tasks and not any(t in init for t in tasks.values()):
        init.append(tasks["transcribe"])

    no_timestamps = settings.get("no_timestamps_token_id", tokens.ids.get(NO_TIMESTAMPS))
    if no_timestamps is not None and init[-1] != no_timestamps:
        init.append(int(no_timestamps))

    at = init.index(None) if detect and None in init else None
    kept = tuple(t for t in init if t is not None)
    chosen = None if detect or len(kept) < 2 or kept[1] not in language_ids else kept[1]
    return DecoderPrompt(kept, chosen, at, frozenset(language_ids) if detect else frozenset())


def _replace_or_add(tokens: list, token: int, among) -> None:
    among = set(among)
    for i, t in enumerate(tokens):
        if t in among:
            tokens[i] = token
            return
    tokens.append(token)


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Word error rate of ``hypotheses`` against ``references`` (``jiwer``): substituted,
    deleted and inserted words over the references' words."""
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    return float(jiwer.wer(list(references), list(hypotheses)))
