"""Choosing the next token: greedy, or sampled with temperature, top-k and top-p (nucleus).

Every random draw comes from the request's seed, its sample index (``-n``) and the position
of the token being chosen, never from which batch or slot it ran in: the same request gives
the same text alone or among others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask to see at each position (OpenAI's limit)."""

MAX_TOP_K = 2**31 - 1
"""The largest ``top_k`` (a device integer holds it); any value at or above the vocabulary's
size keeps every token."""

MAX_TEMPERATURE = 100.0
"""The highest temperature: beyond it every distribution is already as good as uniform."""

SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds a request may give: any signed 64-bit integer (as OpenAI's and vLLM's servers
take them). Each selects a stream of random draws of its own."""

MAX_STOP_STRINGS = 16
"""The most stop strings one request may give (each is searched for after every token)."""

MAX_STOP_LENGTH = 1000
"""The longest stop string, in characters (a stream holds back that much text)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded."""

    max_new_tokens: int = 128
    """Most tokens to generate (fewer when an end-of-sequence token or a stop string comes first)."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy (always the most likely token)."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens only; 0: all of them."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities add up to ``top_p``; 1: all."""
    seed: int = 0
    """Seed of the random draws; the same seed gives the same text."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Strings that end the text where they appear (they are not part of it)."""
    ignore_eos: bool = False
    """Go on past the end-of-sequence token (benchmarks use it to generate a fixed length)."""
    top_logprobs: int = 0
    """Also report, at each generated position, this many of the most likely tokens with their
    log-probabilities (at most :data:`MAX_TOP_LOGPROBS`); 0: only the chosen token's."""

    def problems(self) -> list[str]:
        """What is wrong with these settings, in the words of their fields (empty when nothing)."""
        return [message for _, message in self.field_problems()]

    def field_problems(self) -> list[tuple[str, str]]:
        """``(field, what is wrong with it)`` for each bad setting (empty when nothing): each
        message names the field, the allowed range and the value found."""
        found = []
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            allowed = "an integer of at least 1"
            found.append(("max_new_tokens", f"max_new_tokens must be {allowed}, not {self.max_new_tokens!r}"))
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            allowed = f"a number from 0 (greedy) to {MAX_TEMPERATURE:g}"
            found.append(("temperature", f"temperature must be {allowed}, not {self.temperature!r}"))
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            found.append(("top_k", f"top_k must be an integer from 0 (off) to {MAX_TOP_K}, not {self.top_k!r}"))
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            found.append(("top_p", f"top_p must be in (0, 1], not {self.top_p!r}"))
        low, high = SEED_RANGE
        if not _is_int(self.seed) or not low <= self.seed <= high:
            found.append(("seed", f"seed must be an integer from -2**63 to 2**63 - 1 (64 bits), not {self.seed!r}"))
        found += [("stop", message) for message in stop_problems(self.stop)]
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            allowed = f"0 to {MAX_TOP_LOGPROBS}"
            found.append(("top_logprobs", f"top_logprobs must be {allowed}, not {self.top_logprobs!r}"))
        return found

    @property
    def seed_words(self) -> tuple[int, int]:
        """The seed's 64 bits as two unsigned 32-bit words ``(high, low)``: the key
        ``jax.random.PRNGKey`` makes of a 64-bit seed, so a seed below ``2**32`` draws as it
        always has, and every seed of :data:`SEED_RANGE` has a stream of its own."""
        bits = self.seed % 2**64  # two's complement: one-to-one on SEED_RANGE
        return bits >> 32, bits & 0xFFFFFFFF


def stop_problems(stop) -> list[str]:
    """What is wrong with a list of stop strings (empty when nothing): at most
    :data:`MAX_STOP_STRINGS`, each a non-empty string of at most :data:`MAX_STOP_LENGTH` characters."""
    if len(stop) > MAX_STOP_STRINGS:
        return [f"stop takes at most {MAX_STOP_STRINGS} strings, not {len(stop)}"]
    found = []
    for s in stop:
        if not isinstance(s, str):
            found.append(f"a stop string must be a string, not {s!r}")
        elif not s:
            found.append("a stop string must not be empty")
        elif len(s) > MAX_STOP_LENGTH:
            found.append(f"a stop string may have at most {MAX_STOP_LENGTH} characters, not {len(s)}")
    return found


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A finite real number (not a bool, not NaN, not infinite)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def token_keys(seeds: jax.Array, samples: jax.Array, positions: jax.Array) -> jax.Array:
    """One PRNG key per row: from its seed, its sample index and the position being chosen.
    ``seeds`` is ``[rows]`` (32-bit seeds) or ``[rows, 2]``: each seed's two 32-bit words, high
    first (:attr:`SamplingParams.seed_words`), which are the threefry key of that 64-bit seed."""
    seeds = jnp.asarray(seeds).astype(jnp.uint32)
    if seeds.ndim == 1:
        seeds = jnp.stack([jnp.zeros_like(seeds), seeds], axis=-1)

    def one(seed, sample, position):
        return jax.random.fold_in(jax.random.fold_in(seed, sample), position)

    return jax.vmap(one)(seeds, samples, positions)


def choose_tokens(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
    *,
    sample: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The next token of each row of ``logits`` ``[rows, vocab]`` (float32) and its log-probability
    under the model (before temperature and truncation). ``temperature``, ``top_k`` and ``top_p``
    are per row (see :class:`SamplingParams`); ``keys`` one PRNG key per row. ``sample`` False (a
    static switch): every row is greedy, and nothing is drawn."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1)
    if not sample:  # every row is greedy (known when the program is traced): no random draws
        tokens = greedy.astype(jnp.int32)
        return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    vocab = logits.shape[-1]

    def truncate(scaled):
        # the k-th largest value and the smallest value inside the nucleus bound what is kept
        ordered = -jnp.sort(-scaled, axis=-1)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
        ordered = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], ordered, -jnp.inf)
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each one
        inside = jnp.sum(before < top_p[:, None], axis=-1)  # always >= 1: the first has 0 before it
        nucleus = jnp.take_along_axis(ordered, (inside - 1)[:, None], axis=-1)
        return jnp.where(scaled < jnp.maximum(kth, nucleus), -jnp.inf, scaled)

    needs_truncation = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    scaled = jax.lax.cond(needs_truncation, truncate, lambda s: s, scaled)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, scaled)
    tokens = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
    return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


def top_tokens(logits: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The ``n`` most likely tokens of each row of ``logits`` ``[rows, vocab]`` and their
    log-probabilities, most likely first (``[rows, n]`` each; ``n`` at least 1)."""
    log_probs, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), n)
    return ids.astype(jnp.int32), log_probs
