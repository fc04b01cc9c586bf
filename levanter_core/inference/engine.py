"""An inference engine with continuous batching.

The engine keeps ``max_seqs`` slots, one row of the key/value cache each. A background thread
loops: it admits waiting requests into free slots (prefilling their prompts, several at once,
padded to a length bucket), then runs ``max_rounds`` decoding steps of every slot in one
compiled call, and hands each request its new tokens. A request that ends (an end-of-sequence
token, a stop string, its token budget, the context's end) frees its slot for the next one at
once, so the decoding batch stays full while there is work.

Shapes are bucketed so that each compiles once: prompts to powers of two (at least
``min_prefill``), the number prefilled together to powers of two, and the keys a decoding
step attends over to the power of two that covers the longest live sequence.

Requests come from any thread (:meth:`Engine.submit`); results are read from the returned
:class:`Request`, or streamed through its ``on_update`` callback.

An encoder-decoder model (Whisper; see :mod:`levanter_core.inference.decoding` for the
methods it offers) is served the same way: each request also carries an *encoder input* (a
spectrogram), which the prefill runs through the encoder into the request's row of the
cache, beside its prompt (the decoder's first tokens); decoding then goes on in the same
slots and rounds as text.

This module is the :class:`Engine`: its public side and the thread that schedules the slots.
The requests it takes and gives are in :mod:`~levanter_core.inference.requests`, its compiled
steps in :mod:`~levanter_core.inference.steps`, and how new tokens become results in
:mod:`~levanter_core.inference.delivery`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
from haliax import Axis

from levanter_core.inference import decoding
from levanter_core.inference.delivery import _Delivery
from levanter_core.inference.requests import Completion, Request, RequestError, Update, _Slot
from levanter_core.inference.sampling import MAX_TOP_LOGPROBS, SamplingParams
from levanter_core.inference.steps import _bucket, _decode, _host, _prefill, _sampling

logger = logging.getLogger(__name__)

# The names this module held before it was split (some are imported from here still; the
# engine calls ``_prefill`` and ``_decode`` through this module, so patching them here works).
__all__ = [
    "Completion",
    "Engine",
    "EngineStats",
    "Request",
    "RequestError",
    "Update",
    "_Slot",
    "_bucket",
    "_decode",
    "_host",
    "_prefill",
    "_sampling",
]


@dataclass
class EngineStats:
    """Counters for benchmarks and logs."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    compiles: set = field(default_factory=set)


class Engine(_Delivery):
    """Continuous batching over one model (see the module docstring).

    ``tokenizer`` (a :class:`~levanter_core.data.tokenizer.Tokenizer`) turns tokens into text and
    makes stop strings work; ``eos_ids`` end a sequence. ``max_seq_len`` (default the model's
    ``seq_len``) bounds prompt plus generation. ``max_queued`` requests may wait for a slot; one
    more is refused with status 429. An encoder-decoder model needs an ``encoder_input`` with
    every request (:meth:`submit`); a language model takes none.

    A request whose step fails (an exception while it is prefilled, decoded or turned into
    text) fails alone, with status 500, and the engine goes on with the others. Only a failure
    that leaves the engine unable to go on (its key/value cache lost with the device's state,
    or a fault in its own loop) stops it: every request then fails with 503, new ones are
    refused, and ``on_failure`` (when given) is called with the exception, on the engine's
    thread (a server exits then, for its supervisor to restart it)."""

    def __init__(
        self,
        model,
        *,
        tokenizer=None,
        eos_ids: tuple[int, ...] = (),
        max_seqs: int = 16,
        max_seq_len: int | None = None,
        max_queued: int = 256,
        max_rounds: int = 4,
        max_prefill_seqs: int = 8,
        min_prefill: int = 16,
        on_failure: Callable[[BaseException], None] | None = None,
    ):
        name = getattr(getattr(model, "config", None), "type", type(model).__name__)
        decoding.check_can_generate(model, name)
        self.model = model
        self.name = name
        self.encoder_input_axes: tuple[Axis, ...] | None = (
            tuple(model.encoder_input_axes) if decoding.is_encoder_decoder(model) else None
        )
        """The axes of a request's encoder input; None for a language model (which takes none)."""
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.max_seqs = max_seqs
        self.max_seq_len = int(max_seq_len or model.config.seq_len)
        self.max_queued = max_queued
        self.max_rounds = max_rounds
        self.max_prefill_seqs = max(1, min(max_prefill_seqs, max_seqs))
        self.min_prefill = min(min_prefill, self.max_seq_len)
        self.stats = EngineStats()
        self._Batch = Axis("batch", max_seqs)
        self._KeyPos = Axis("key_position", self.max_seq_len)
        self._cache = None
        self._slots: list[_Slot | None] = [None] * max_seqs
        self._queue: collections.deque[Request] = collections.deque()
        self._lock = threading.Condition()
        self._closing = False
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.on_failure = on_failure

    # -- the public side ---------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            if self._cache is None:
                self._cache = decoding.slot_cache(self.model, self._Batch, self._KeyPos)
            self._thread = threading.Thread(target=self._run, name="levanter-engine", daemon=True)
            self._thread.start()
        return self

    def precompile(self, *, top_logprobs: bool = False) -> int:
        """Compile every prefill and decoding shape this engine can meet, so that no request ever
        waits on a compilation (a server calls it before it listens). Call it before the first
        request. ``top_logprobs``: the variants that report alternatives too. Returns how many
        programs it compiled (or found compiled)."""
        if self._thread is not None:
            raise RuntimeError("precompile() must come before the engine's first request")
        if self._cache is None:
            self._cache = decoding.slot_cache(self.model, self._Batch, self._KeyPos)
        variants = [
            (top_n, sample) for top_n in ((0, MAX_TOP_LOGPROBS) if top_logprobs else (0,)) for sample in (False, True)
        ]

        def buckets(smallest, largest, most):
            return sorted({_bucket(n, smallest, largest) for n in range(1, most + 1)})

        seq_len = self.max_seq_len
        count = 0
        for top_n, sample in variants:
            for rows in buckets(1, self.max_prefill_seqs, self.max_prefill_seqs):
                params = self._params([], rows)
                ones = np.ones(rows, np.int32)
                past_the_end = np.full(rows, self.max_seqs, np.int32)  # every row's slot: nothing is written
                inputs = self._encoder_inputs([], rows)
                for length in buckets(self.min_prefill, seq_len, seq_len - 1):
                    tokens = np.zeros((rows, length), np.int32)
                    self._cache, *_ = _prefill(
                        self._cache, self.model, tokens, ones, past_the_end, *params, inputs,
                        key_positions=self._KeyPos, top_n=top_n, sample=sample,
                    )  # fmt: skip
                    self.stats.compiles.add(("prefill", rows, length, top_n, sample))
                    count += 1
            params = self._params([], self.max_seqs)
            # writes position 0 of every row, which a request's prefill writes before anything reads it
            zeros = np.zeros(self.max_seqs, np.int32)
            for key_len in buckets(self.min_prefill, seq_len, seq_len - 1 + self.max_rounds):
                self._cache, *_ = _decode(
                    self._cache, self.model, zeros, zeros, *params,
                    key_len=key_len, rounds=self.max_rounds, top_n=top_n, sample=sample,
                )  # fmt: skip
                self.stats.compiles.add(("decode", key_len, top_n, sample))
                count += 1
        jax.block_until_ready(self._cache)
        return count

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def check(self, prompt: list[int], params: SamplingParams, encoder_input=None) -> None:
        """Raise :class:`RequestError` (400) for a request that cannot be served as asked."""
        problems = params.field_problems()
        if problems:
            raise RequestError("; ".join(m for _, m in problems), field=problems[0][0])
        self._check_encoder_input(encoder_input)
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token", field="prompt")
        limit = self.max_seq_len
        if len(prompt) >= limit:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens, but this model's context is {limit} tokens "
                "(the prompt and what is generated must fit in it)",
                field="prompt",
            )
        if len(prompt) + params.max_new_tokens > limit:
            raise RequestError(
                f"the prompt ({len(prompt)} tokens) and max_tokens ({params.max_new_tokens}) add up to "
                f"{len(prompt) + params.max_new_tokens} tokens, more than this model's context of {limit} "
                f"tokens; ask for at most {limit - len(prompt)} new tokens",
                field="max_new_tokens",
            )
        vocab = self.model.Vocab.size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token {bad[0]} is outside the vocabulary (0 to {vocab - 1})", field="prompt")

    def _check_encoder_input(self, encoder_input) -> None:
        axes = self.encoder_input_axes
        if axes is None:
            if encoder_input is not None:
                raise RequestError(
                    f"model type {self.name!r} is a language model: a request gives it a prompt and no encoder input",
                    field="encoder_input",
                )
            return
        expected = "(" + ", ".join(f"{ax.name}={ax.size}" for ax in axes) + ")"
        if encoder_input is None:
            raise RequestError(
                f"model type {self.name!r} is an encoder-decoder: each request needs an encoder input "
                f"{expected} beside its prompt (the decoder's first tokens)",
                field="encoder_input",
            )
        shape = tuple(np.shape(encoder_input))
        if shape != tuple(ax.size for ax in axes):
            raise RequestError(
                f"the encoder input has shape {shape}; model type {self.name!r} takes {expected}",
                field="encoder_input",
            )

    @property
    def accepting(self) -> bool:
        """Whether :meth:`submit` takes new requests (False once shutting down or failed)."""
        return self.refusal() is None

    @property
    def failed(self) -> BaseException | None:
        """What stopped the engine, if it has failed (None while it works)."""
        return self._failed

    def refusal(self) -> str | None:
        """Why the engine refuses new requests (it is shutting down, it failed), or None."""
        if self._failed is not None:
            return f"the engine has failed: {self._failed}"
        if self._closing:
            return "the engine is shutting down"
        return None

    def submit(
        self, prompt: list[int], params: SamplingParams, *, index: int = 0, on_update=None, encoder_input=None
    ) -> Request:
        """Queue a request (``index``: its sample number among a prompt's ``n``; ``encoder_input``:
        an encoder-decoder's input, an array of :attr:`encoder_input_axes`' shape). Raises
        :class:`RequestError`: 400 for a bad request, 429 when the queue is full, 503 when the
        engine is shutting down or has failed."""
        self.check(prompt, params, encoder_input)
        request = Request(list(prompt), params, index, on_update, encoder_input)
        request.row = self._row(params, index)
        with self._lock:
            refusal = self.refusal()
            if refusal is not None:
                raise RequestError(refusal, status=503)
            if len(self._queue) >= self.max_queued:
                raise RequestError(
                    f"too many requests: {len(self._queue)} are already waiting (the queue holds "
                    f"{self.max_queued}); retry later",
                    status=429,
                )
            self._queue.append(request)
            self._lock.notify_all()
        self.start()
        return request

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, encoder_inputs=None
    ) -> list[list[Completion]]:
        """``n`` completions of each prompt, all batched together (waits for them);
        ``encoder_inputs``: an encoder-decoder's input for each prompt."""
        inputs = [None] * len(prompts) if encoder_inputs is None else list(encoder_inputs)
        if len(inputs) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(inputs)} encoder inputs")
        for prompt, x in zip(prompts, inputs):
            self.check(prompt, params, x)
        requests = [[self._submit_waiting(p, params, i, x) for i in range(n)] for p, x in zip(prompts, inputs)]
        return [[r.result() for r in row] for row in requests]

    def _submit_waiting(self, prompt, params, index, encoder_input=None) -> Request:
        while True:  # more prompts than the queue holds: wait for room rather than fail
            try:
                return self.submit(prompt, params, index=index, encoder_input=encoder_input)
            except RequestError as e:
                if e.status != 429:
                    raise
                time.sleep(0.01)

    def pending(self) -> int:
        """Requests waiting or being decoded."""
        with self._lock:
            return len(self._queue) + sum(s is not None for s in self._slots)

    def shutdown(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with ``drain``, finish every accepted one first, else cancel them."""
        with self._lock:
            self._closing = True
            if not drain:
                for request in self._queue:
                    request.cancel()
                for slot in self._slots:
                    if slot is not None:
                        slot.request.cancel()
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        admitted: list[tuple[int, Request]] = []
        try:
            while True:
                with self._lock:
                    while not self._queue and not any(self._slots) and not self._closing:
                        self._lock.wait()
                    if self._closing and not self._queue and not any(self._slots):
                        return
                    admitted = self._take_admissions()
                if admitted:
                    self._step([r for _, r in admitted], self._prefill, admitted)
                live = [s.request for s in self._slots if s is not None]
                if live:
                    self._step(live, self._decode_round)
        except BaseException as e:  # an engine failure fails every request rather than hanging it
            logger.exception("the inference engine failed")
            with self._lock:
                self._failed = e
                # those being prefilled when it failed are in neither the queue nor a slot yet
                busy = [s.request for s in self._slots if s is not None]
                waiting = list(self._queue) + busy + [r for _, r in admitted if r not in busy and not r.done()]
                self._queue.clear()
                self._slots = [None] * self.max_seqs
            for request in waiting:
                self._fail(request, RequestError(f"the engine failed: {e}", status=503))
            if self.on_failure is not None:
                self.on_failure(e)

    def _step(self, requests: list[Request], run, *args) -> None:
        """``run(*args)``, a step over ``requests``; if it raises, those requests fail (500) and
        the engine goes on, unless the step lost the key/value cache (the device's state of every
        sequence), which the engine cannot go on without: that error is raised."""
        try:
            run(*args)
        except Exception as e:
            if self._cache_lost():
                raise
            logger.exception("a step of the inference engine failed; failing its %d requests", len(requests))
            for request in requests:
                if not request.done():
                    self._fail(request, RequestError(f"generating this answer failed: {type(e).__name__}: {e}", 500))

    def _cache_lost(self) -> bool:
        """Whether the key/value cache's buffers are gone (a failed step that had been given them)."""
        leaves = jax.tree.leaves(self._cache)
        return not leaves or any(getattr(x, "is_deleted", lambda: False)() for x in leaves)

    def _fail(self, request: Request, error: RequestError) -> None:
        """End ``request`` with ``error`` (its slot, if it has one, is freed; its listener hears of it)."""
        for i, slot in enumerate(self._slots):
            if slot is not None and slot.request is request:
                self._slots[i] = None
        request._error = error
        request._done.set()
        self._notify(request, Update("", [], [], error=error))

    def _guarded(self, request: Request, run, *args) -> None:
        """``run(*args)`` for ``request`` alone: an exception fails that request (500), no other."""
        try:
            run(*args)
        except Exception as e:
            logger.exception("handling a request's new tokens failed; failing the request")
            self._fail(request, RequestError(f"generating this answer failed: {type(e).__name__}: {e}", 500))

    def _take_admissions(self) -> list[tuple[int, Request]]:
        free = [i for i, s in enumerate(self._slots) if s is None]
        admitted: list[tuple[int, Request]] = []
        while self._queue and free and len(admitted) < self.max_prefill_seqs:
            request = self._queue.popleft()
            if request.cancelled:
                self._finish_cancelled(request)
                continue
            admitted.append((free.pop(0), request))
        return admitted

    def _prefill(self, admitted: list[tuple[int, Request]]) -> None:
        started = time.perf_counter()
        rows = _bucket(len(admitted), 1, self.max_prefill_seqs)
        length = _bucket(max(len(r.prompt) for _, r in admitted), self.min_prefill, self.max_seq_len)
        tokens = np.zeros((rows, length), np.int32)
        lengths = np.ones(rows, np.int32)
        slots = np.full(rows, self.max_seqs, np.int32)  # padding rows go past the cache: dropped
        for i, (slot, request) in enumerate(admitted):
            tokens[i, : len(request.prompt)] = request.prompt
            lengths[i] = len(request.prompt)
            slots[i] = slot
        params = self._params([r for _, r in admitted], rows)
        inputs = self._encoder_inputs([r for _, r in admitted], rows)
        top_n, sample = self._top_n(r for _, r in admitted), _sampling(r for _, r in admitted)
        self.stats.compiles.add(("prefill", rows, length, top_n, sample))
        self._cache, new_tokens, logprobs, top_ids, top_lps = _prefill(
            self._cache, self.model, tokens, lengths, slots, *params, inputs,
            key_positions=self._KeyPos, top_n=top_n, sample=sample,
        )  # fmt: skip
        new_tokens, logprobs = np.asarray(new_tokens), np.asarray(logprobs)
        top_ids, top_lps = _host(top_ids, rows), _host(top_lps, rows)
        self.stats.prefill_tokens += int(lengths[: len(admitted)].sum())
        self.stats.prefill_seconds += time.perf_counter() - started
        for i, (slot, request) in enumerate(admitted):
            self._slots[slot] = _Slot(request, len(request.prompt), int(new_tokens[i]))
            chosen = ([int(new_tokens[i])], [float(logprobs[i])], top_ids[i : i + 1], top_lps[i : i + 1])
            self._guarded(request, self._accept, slot, *chosen)

    def _decode_round(self) -> None:
        started = time.perf_counter()
        live = [(i, s) for i, s in enumerate(self._slots) if s is not None]
        rounds = self.max_rounds
        tokens = np.zeros(self.max_seqs, np.int32)
        positions = np.zeros(self.max_seqs, np.int32)
        for i, slot in live:
            tokens[i], positions[i] = slot.token, slot.position
        key_len = _bucket(int(positions.max()) + rounds, self.min_prefill, self.max_seq_len)
        params = self._params([s.request if s else None for s in self._slots], self.max_seqs)
        top_n, sample = self._top_n(s.request for _, s in live), _sampling(s.request for _, s in live)
        self.stats.compiles.add(("decode", key_len, top_n, sample))
        self._cache, out_tokens, out_logprobs, top_ids, top_lps = _decode(
            self._cache, self.model, tokens, positions, *params,
            key_len=key_len, rounds=rounds, top_n=top_n, sample=sample,
        )  # fmt: skip
        out_tokens, out_logprobs = np.asarray(out_tokens), np.asarray(out_logprobs)
        top_ids, top_lps = _host(top_ids, self.max_seqs, rounds), _host(top_lps, self.max_seqs, rounds)
        self.stats.decode_steps += rounds
        self.stats.decode_seconds += time.perf_counter() - started
        for i, slot in live:
            slot.position += rounds
            slot.token = int(out_tokens[i, -1])
            self.stats.decode_tokens += rounds
            chosen = (out_tokens[i].tolist(), out_logprobs[i].tolist(), top_ids[i], top_lps[i])
            self._guarded(slot.request, self._accept, i, *chosen)

    @staticmethod
    def _top_n(requests) -> int:
        """How many alternatives the compiled step reports: none unless a request asks (one more
        compiled variant, with the most any request may ask for, rather than one per count)."""
        return MAX_TOP_LOGPROBS if any(r.params.top_logprobs for r in requests) else 0

    def _encoder_inputs(self, requests, rows: int):
        """The requests' encoder inputs, ``[rows, *encoder_input_axes]`` (zeros for padding rows),
        handed over to the device (a request keeps none: its row of the cache holds what the
        encoder made of it); None for a language model."""
        if self.encoder_input_axes is None:
            return None
        shape = tuple(ax.size for ax in self.encoder_input_axes)
        inputs = np.zeros((rows, *shape), decoding.encoder_input_dtype(self.model))
        for i, request in enumerate(requests):
            inputs[i] = request.encoder_input
            request.encoder_input = None
        return inputs

    def _row(self, params: SamplingParams, index: int) -> tuple:
        """A request's settings as the compiled steps take them: ``(temperature, top_k, top_p,
        seed words, sample index)`` in their device types. ``top_k`` past the vocabulary keeps
        every token, as the vocabulary's size does; a seed is its two 32-bit words (see
        :attr:`SamplingParams.seed_words`). Made when the request is submitted, so that a value
        that does not fit fails that request there, never the engine's loop."""
        try:
            top_k = min(params.top_k, self.model.Vocab.size)
            return (
                np.float32(params.temperature), np.int32(top_k), np.float32(params.top_p),
                np.array(params.seed_words, np.uint32), np.int32(index),
            )  # fmt: skip
        except (OverflowError, TypeError, ValueError) as e:
            raise RequestError(f"the request's settings do not fit the engine: {e}") from None

    def _params(self, requests, rows: int):
        temperature = np.zeros(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        top_p = np.ones(rows, np.float32)
        seeds = np.zeros((rows, 2), np.uint32)
        samples = np.zeros(rows, np.int32)
        for i, request in enumerate(requests):
            if request is None:
                continue
            if request.row is None:
                request.row = self._row(request.params, request.index)
            temperature[i], top_k[i], top_p[i], seeds[i], samples[i] = request.row
        return temperature, top_k, top_p, seeds, samples
