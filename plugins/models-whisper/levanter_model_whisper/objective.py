"""Speech recognition as a training objective (``asr``, the objective ``type: whisper`` names).

A batch holds each utterance's samples ``[rows, samples]`` (16 kHz, padded with silence or cut to
the window the encoder hears: ``2 * max_source_positions`` frames of 160 samples, 30 s for
Whisper) and its transcript's token ids ``[rows, position]`` (the decoder's start tokens, the
words, the end-of-text token, then padding), with a loss mask that is 1 where a position's
*next* token is part of the transcript. This is what the ``audio`` data format
(:mod:`levanter_audio.format`, which sources default to in a run of this objective) stores and
the core's ``document`` layout reads.

The log-mel features are computed from the samples on the device, inside the compiled step
(:func:`levanter_audio.features.log_mel_spectrogram_jax`). The loss is the mean cross-entropy of
each transcript token given the audio and the tokens before it, computed fused with the output
projection as language modelling's is. Evaluation sums ``[nats, tokens, word errors, words]``:
the loss, and the word error rate of greedy transcripts of the validation audio against their
references (words lowercased, punctuation other than apostrophes dropped).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jiwer
import numpy as np
from haliax import NamedArray
from levanter_audio.features import HOP_LENGTH, log_mel_spectrogram_jax
from levanter_audio.format import transcript_prompt

from levanter_core.data.tokenizer import load_tokenizer
from levanter_core.errors import ConfigError
from levanter_core.models.lm import next_token_loss
from levanter_core.objective import BatchField, Objective
from levanter_core.trainer.evaluators import eval_metrics

AUDIO = "audio"
"""The batch's array of samples (the ``audio`` format's document field)."""


@dataclasses.dataclass
class SpeechBatch:
    """Host arrays of a batch of utterances, as a run's data gives them (a ``data.Batch`` with
    ``fields["audio"]`` is read the same way)."""

    audio: np.ndarray
    """float32 ``[rows, samples]``: 16 kHz samples, padded with zeros to the encoder's window."""
    tokens: np.ndarray
    """int32 ``[rows, position]``: each transcript's token ids, padded."""
    loss_mask: np.ndarray
    """``[rows, position]``: 1 where the token *after* the position is part of the transcript."""


class SpeechExample(eqx.Module):
    """A batch of utterances on the mesh, as named arrays."""

    audio: NamedArray
    tokens: NamedArray
    loss_mask: NamedArray


class SpeechRecognition(Objective):
    """The ``asr`` objective: transcripts scored given their audio."""

    name = "asr"
    default_format = {"type": "audio"}
    eval_counts = {1: "tokens", 3: "words"}

    def __init__(self, *, tokenizer=None, prompt: Sequence[int] | None = None, eval_max_tokens: int | None = None):
        """``tokenizer`` (a :class:`~levanter_core.data.tokenizer.Tokenizer`) and ``prompt`` (the
        token ids every transcript starts with) are needed for the word error rate of evaluation,
        which transcribes greedily up to ``eval_max_tokens`` tokens (default: as many as the
        decoder's positions allow); without them evaluation reports the loss alone."""
        self.tokenizer = tokenizer
        self.prompt = list(prompt) if prompt is not None else None
        self.eval_max_tokens = eval_max_tokens

    @classmethod
    def from_config(cls, config) -> SpeechRecognition:
        formats = {source.format.type for source in config.data.configs.values()}
        if formats != {"audio"}:
            raise ConfigError(
                f"model.type {config.model.type!r} trains with the asr objective, which reads audio with transcripts; "
                f"the data's format is {', '.join(sorted(formats))}: set data format: {{type: audio}} (or leave the "
                "format out, which means audio for this model)"
            )
        tokenizer = load_tokenizer(config.data.tokenizer)
        enforce_bos = all(source.format.enforce_bos for source in config.data.configs.values())
        return cls(tokenizer=tokenizer, prompt=transcript_prompt(tokenizer, enforce_bos))

    @classmethod
    def for_evaluation(cls, model_config, tokenizer) -> SpeechRecognition:
        """Scores transcripts stored by the ``audio`` format with its defaults (``enforce_bos``)."""
        return cls(tokenizer=tokenizer, prompt=transcript_prompt(tokenizer))

    @classmethod
    def row_lengths(cls, model_config) -> dict[str, int]:
        """The encoder's window in samples: ``2 * max_source_positions`` frames of 160."""
        return {AUDIO: model_config.Frames.size * HOP_LENGTH}

    def fields(self, batch) -> dict[str, BatchField]:
        audio = batch.audio if isinstance(batch, SpeechBatch) else batch.fields[AUDIO]
        return {
            AUDIO: BatchField(audio, ("samples",), np.float32),
            "tokens": BatchField(batch.tokens, ("position",), np.int32),
            "loss_mask": BatchField(batch.loss_mask, ("position",), np.float32),
        }

    def example(self, arrays) -> SpeechExample:
        return SpeechExample(arrays[AUDIO], arrays["tokens"], arrays["loss_mask"])

    def _hidden(self, model, example: SpeechExample, key):
        states = model.encode(features_of(model, example.audio), key=key)
        return model.decoder_activations(example.tokens, states, key=key)

    def loss(self, model, example: SpeechExample, *, key) -> tuple[jax.Array, dict]:
        hidden = self._hidden(model, example, key)
        return next_token_loss(model, example.tokens, example.loss_mask, hidden=hidden), {}

    def eval_totals(self, model, example: SpeechExample, *constants) -> jax.Array:
        """``[nats, tokens]``: the summed cross-entropy of the transcripts' tokens and their count."""
        hidden = self._hidden(model, example, None)
        nats = next_token_loss(model, example.tokens, example.loss_mask, hidden=hidden, reduction="sum")
        # the tokens scored: the mask, less each row's last position (it predicts nothing)
        Pos = example.tokens.resolve_axis("position")
        counted = hax.sum(example.loss_mask * (hax.arange(Pos) < Pos.size - 1)).scalar()
        return jnp.stack([nats, counted]).astype(jnp.float32)

    # -- word error rate ----------------------------------------------------------------------
    def eval_outputs(self, model, example: SpeechExample):
        """Greedy transcripts of the batch's audio ``[rows, max_tokens]`` with the references
        they are scored against (the batch's tokens and loss mask); None without a tokenizer."""
        if self.tokenizer is None or self.prompt is None:
            return None
        max_tokens = self.eval_max_tokens or model.config.seq_len - len(self.prompt)
        hypotheses = greedy_tokens(model, features_of(model, example.audio), self.prompt, max_tokens)
        return hypotheses, example.tokens.array, example.loss_mask.array

    def eval_output_totals(self, outputs) -> np.ndarray:
        """``[word errors, reference words]`` of a batch's greedy transcripts."""
        hypotheses, tokens, loss_mask = outputs
        eos = self.tokenizer.eos_id
        errors = words = 0
        for hypothesis, row, mask in zip(np.asarray(hypotheses), np.asarray(tokens), np.asarray(loss_mask)):
            length = int(np.asarray(mask).sum()) + 1  # the transcript's tokens: each scored one, and the first
            reference = _text(self.tokenizer, row[len(self.prompt) : length], eos)
            said = _text(self.tokenizer, hypothesis, eos)
            e, n = word_errors(reference, said)
            errors, words = errors + e, words + n
        return np.array([errors, words], np.float64)

    def eval_metrics(self, totals, tags, *, per_set: bool) -> dict[str, float]:
        """The loss of :func:`~levanter_core.trainer.evaluators.eval_metrics` and the word error
        rate ``eval/wer`` (over every set's words; per set and tag like the loss)."""
        metrics = eval_metrics({name: t[:2] for name, t in totals.items()}, tags, per_set=per_set)
        if not all(len(t) >= 4 for t in totals.values()):
            return metrics

        def wer(names):
            errors, words = sum(totals[n][2] for n in names), sum(totals[n][3] for n in names)
            return errors / words if words else None

        groups = {"eval": list(totals)}
        if per_set:
            groups |= {f"eval/{name}": [name] for name in totals}
        groups |= {f"eval/{tag}": [n for n in names if n in totals] for tag, names in tags.items()}
        for prefix, names in groups.items():
            if names and wer(names) is not None:
                metrics[f"{prefix}/wer"] = wer(names)
        return metrics


def features_of(model, audio: NamedArray) -> NamedArray:
    """The log-mel spectrograms ``(batch, mels, frames)`` of samples ``(batch, samples)``, as the
    model's encoder takes them, computed on the device."""
    config = model.config
    Batch = audio.axes[0]
    mels = log_mel_spectrogram_jax(audio.array, n_mels=config.num_mel_bins)
    return hax.named(mels, (Batch, config.Mels, config.Frames))


def greedy_tokens(model, features: NamedArray, prompt: Sequence[int], max_tokens: int) -> jax.Array:
    """The ``max_tokens`` ids a greedy decoder reads after ``prompt`` for each row of
    ``features``, int32 ``[rows, max_tokens]`` (past an end-of-text token they mean nothing).
    Traceable: the encoder runs once, the prompt in one decoding step, then one token per step in
    a loop, through the cross-attention cache."""
    Batch = features.axes[0]
    total = len(prompt) + max_tokens
    cache = model.init_decoder_cache(model.encode(features), hax.Axis("key_position", total))
    head = model.get_lm_head()

    def choose(hidden):
        logits = hax.dot(hidden["position", -1], head, axis="embed")
        return hax.argmax(logits, axis=model.Vocab).array.astype(jnp.int32)

    tokens = hax.named(jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (Batch.size, len(prompt))), (Batch, "position"))
    positions = hax.named(
        jnp.broadcast_to(jnp.arange(len(prompt), dtype=jnp.int32), (Batch.size, len(prompt))), (Batch, "position")
    )
    hidden, cache = model.decode_step(tokens, positions, cache, key_len=total)
    first = choose(hidden)

    def step(carry, t):
        last, cache = carry
        token = hax.named(last[:, None], (Batch, "position"))
        position = hax.named(jnp.full((Batch.size, 1), len(prompt) + t, jnp.int32), (Batch, "position"))
        hidden, cache = model.decode_step(token, position, cache, key_len=total)
        chosen = choose(hidden)
        return (chosen, cache), chosen

    (_, _), rest = jax.lax.scan(step, (first, cache), jnp.arange(max_tokens - 1))
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def _text(tokenizer, ids, eos: int | None) -> str:
    ids = [int(i) for i in ids]
    if eos is not None and eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer.decode(ids)


_PUNCTUATION = re.compile(r"[^\w\s']")


def normalize_words(text: str) -> list[str]:
    """The words a word error rate compares: lowercased, punctuation other than apostrophes
    dropped, split on white space."""
    return _PUNCTUATION.sub(" ", text.lower()).split()


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """Substituted, deleted and inserted words of ``hypothesis`` against ``reference`` (both
    normalized by :func:`normalize_words`), and the reference's words (``jiwer``)."""
    ref, hyp = normalize_words(reference), normalize_words(hypothesis)
    if not ref:
        return len(hyp), 0
    if not hyp:
        return len(ref), len(ref)
    out = jiwer.process_words(" ".join(ref), " ".join(hyp))
    return out.substitutions + out.deletions + out.insertions, len(ref)
