r"""What a client of the inference engine holds: the :class:`Request` it submitted, the
:class:`Update`\ s and :class:`Completion` it receives, and the :class:`RequestError` that
refuses or fails it (see :mod:`levanter_core.inference.engine`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from levanter_core.errors import UserError
from levanter_core.inference.sampling import SamplingParams


class RequestError(UserError):
    """A request that cannot be served as asked; ``status`` is its HTTP status (400: bad input,
    429: the queue is full, 500: generating it failed (the engine goes on with the others), 503:
    the engine is shutting down or broken); ``field``, when one is
    to blame, the request's field in :class:`SamplingParams`'s words (``prompt``,
    ``max_new_tokens``, ``temperature``, ...)."""

    def __init__(self, message: str, status: int = 400, *, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field


@dataclass
class Completion:
    """One finished generation."""

    prompt_tokens: list[int]
    tokens: list[int]
    """The generated tokens (without the end-of-sequence token that ended them)."""
    logprobs: list[float]
    """The log-probability of each generated token under the model (before temperature and truncation)."""
    text: str | None
    """The generated text, cut before the stop string that ended it (None without a tokenizer)."""
    finish_reason: str
    """``stop`` (an end-of-sequence token or a stop string) or ``length`` (the token budget or the
    model's context ran out)."""
    index: int = 0
    """Which of a prompt's samples this is (``-n``)."""
    time_to_first_token: float | None = None
    """Seconds from submission to the first generated token."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``SamplingParams.top_logprobs``: at each generated position, the most likely tokens
    and their log-probabilities, most likely first (None when not asked for)."""


@dataclass
class Update:
    """What a request got since the last update: new text and tokens, and whether it ended."""

    text: str
    tokens: list[int]
    logprobs: list[float]
    finished: Completion | None = None
    """The completion, on a request's last update."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """The alternatives at each new token's position, when the request asked for them."""
    error: BaseException | None = None
    """Why the request failed (the engine broke), on its last update; ``finished`` is then None."""


class Request:
    """A submitted request: wait on it with :meth:`result`, or stream it through ``on_update``."""

    def __init__(self, prompt: list[int], params: SamplingParams, index: int, on_update, encoder_input=None):
        self.prompt = prompt
        self.encoder_input = encoder_input
        """An encoder-decoder's input (a numpy array), until the prefill has used it."""
        self.params = params
        self.index = index
        self.on_update: Callable[[Update], None] | None = on_update
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.emitted = 0  # characters of text already given to on_update
        self.cancelled = False
        self.row: tuple | None = None
        """The request's settings as the compiled steps take them (set by :meth:`Engine.submit`)."""
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._error: BaseException | None = None

    def result(self, timeout: float | None = None) -> Completion:
        """The completion, once the request has ended (raises the engine's error if it failed)."""
        if not self._done.wait(timeout):
            raise TimeoutError("the request has not finished")
        if self._error is not None:
            raise self._error
        assert self._completion is not None  # a request is done with an error or with its completion
        return self._completion

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating (a client that went away); the slot is freed at the next step."""
        self.cancelled = True


@dataclass
class _Slot:
    """A row of the engine's batch and the request decoding in it."""

    request: Request
    position: int  # where the last token (the next one fed to the model) sits
    token: int
