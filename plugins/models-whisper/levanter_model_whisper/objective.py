"""Speech recognition as a training objective (``asr``, the objective ``type: whisper`` names).

A batch is :class:`SpeechBatch`: log-mel spectrograms ``[rows, mels, frames]`` and the
transcripts' token ids ``[rows, position]`` (the decoder's prompt tokens, the text, the
end-of-text token, then padding), with a loss mask that is 1 where a position's *next* token
is scored. The loss is the mean cross-entropy of each transcript token given the audio and the
tokens before it, computed fused with the output projection as language modelling's is; the
encoder runs once per row. Evaluation sums ``[nats, tokens]``, which gives ``eval/loss``.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from levanter_core.errors import ConfigError
from levanter_core.models.lm import next_token_loss
from levanter_core.objective import BatchField, Objective


@dataclasses.dataclass
class SpeechBatch:
    """Host arrays of a batch of utterances."""

    features: np.ndarray
    """float32 ``[rows, mels, frames]``: log-mel spectrograms (``levanter_audio.features``)."""
    tokens: np.ndarray
    """int32 ``[rows, position]``: each transcript's token ids, padded."""
    loss_mask: np.ndarray
    """``[rows, position]``: 1 where the token *after* the position is part of the transcript."""


class SpeechExample(eqx.Module):
    """A :class:`SpeechBatch` on the mesh, as named arrays."""

    features: NamedArray
    tokens: NamedArray
    loss_mask: NamedArray


class SpeechRecognition(Objective):
    """The ``asr`` objective: transcripts scored given their audio."""

    name = "asr"

    @classmethod
    def from_config(cls, config) -> "SpeechRecognition":
        """Refuses a run whose data cannot feed it: the core's data sources give tokenized text,
        and no data source of audio with transcripts exists yet."""
        raise ConfigError(
            f"model.type {config.model.type!r} trains with the asr objective, which needs audio with "
            "transcripts; the run's data (data:) is tokenized text, and audio data sources are not available "
            "yet. Use the model through encode()/decode(), or SpeechRecognition with the Trainer directly"
        )

    def fields(self, batch: SpeechBatch) -> dict[str, BatchField]:
        return {
            "features": BatchField(batch.features, ("mels", "frames"), np.float32),
            "tokens": BatchField(batch.tokens, ("position",), np.int32),
            "loss_mask": BatchField(batch.loss_mask, ("position",), np.float32),
        }

    def example(self, arrays) -> SpeechExample:
        return SpeechExample(arrays["features"], arrays["tokens"], arrays["loss_mask"])

    def _hidden(self, model, example: SpeechExample, key):
        states = model.encode(example.features, key=key)
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
