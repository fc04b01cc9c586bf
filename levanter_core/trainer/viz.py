"""``trainer.viz``: what the model finds easy and hard, token by token.

Every ``interval`` steps the model scores a few validation sequences: the
log-probability it gives each token given the ones before. The scores are
drawn as an HTML heatmap (one line of colored tokens per sequence; hovering
shows the token and its log-probability), written to
``{run_dir}/viz/step-{N}.html`` and sent to every tracker as an artifact of
type ``viz``. Reading it shows at a glance which parts of the data the model
has learned (pale) and which surprise it (red): boilerplate, repeated
licences, broken documents and the like stand out.
"""

from __future__ import annotations

import html
import os

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
from pydantic import Field, PositiveInt

from levanter_core.config.base import ConfigModel
from levanter_core.models.lm import LmExample, _attn_kwargs, per_token_cross_entropy

WORST = -10.0
"""Log-probabilities at or below this are drawn in the full color."""


class VizConfig(ConfigModel):
    """The token log-probability heatmap."""

    interval: PositiveInt = Field(1000)
    """Draw it every this many steps (and after the last step)."""
    num_sequences: PositiveInt = 4
    """How many validation sequences to draw (the first ones, the same every time)."""
    max_tokens: PositiveInt | None = 512
    """Draw at most this many tokens of each sequence. None: all of them."""


@eqx.filter_jit
def token_log_probs(model, example: LmExample) -> jnp.ndarray:
    """``[batch, position]``: the log-probability of each token given the tokens before it
    (the first position, which nothing predicts, is NaN)."""
    tokens = example.tokens
    Pos = tokens.resolve_axis("position")
    hidden = model.activations(tokens, **_attn_kwargs(example))
    targets = hax.roll(tokens, -1, Pos)
    nll = per_token_cross_entropy(model, hidden, targets)
    predicted = -nll.rearrange((..., Pos.name)).array  # position t scores token t + 1
    first = jnp.full(predicted.shape[:-1] + (1,), jnp.nan, predicted.dtype)
    return jnp.concatenate([first, predicted[..., :-1]], axis=-1)


def heatmap_html(title: str, rows: list[tuple[list[str], np.ndarray]]) -> str:
    """An HTML page with one line per ``(token texts, log-probabilities)`` row."""
    lines = []
    for texts, scores in rows:
        spans = []
        for text, score in zip(texts, scores):
            shown = html.escape(text).replace("\n", "↵<br>")
            if np.isnan(score):
                spans.append(f'<span title="(first token)">{shown}</span>')
                continue
            strength = min(max(score / WORST, 0.0), 1.0)
            color = f"rgba(220, 30, 30, {strength:.2f})"
            label = html.escape(f"{text!r}: log p = {score:.2f}")
            spans.append(f'<span style="background:{color}" title="{label}">{shown}</span>')
        lines.append(f'<div class="seq">{"".join(spans)}</div>')
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif} .seq{font-family:monospace;white-space:pre-wrap;"
        "border:1px solid #ccc;margin:1em 0;padding:.5em;line-height:1.6}"
        f"</style></head><body><h1>{html.escape(title)}</h1>"
        "<p>Each token is shaded by how unlikely the model found it (pale: expected; red: "
        f"log-probability {WORST:g} or lower). Hover for the value.</p>" + "".join(lines) + "</body></html>"
    )


def write_heatmap(run_dir: str, step: int, tokenizer, tokens: np.ndarray, scores: np.ndarray, limit: int | None) -> str:
    """Write ``{run_dir}/viz/step-{step}.html`` for ``tokens`` and ``scores`` (``[rows, seq]``)
    and return its path."""
    rows = []
    for ids, row_scores in zip(tokens, scores):
        ids, row_scores = ids[:limit], row_scores[:limit]
        rows.append(([tokenizer.decode([int(i)]) for i in ids], np.asarray(row_scores, np.float64)))
    path = os.path.join(run_dir, "viz", f"step-{step}.html")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(heatmap_html(f"Token log-probabilities at step {step}", rows))
    return path
