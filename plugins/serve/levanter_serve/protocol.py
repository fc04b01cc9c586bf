"""The OpenAI request bodies this server reads, as pydantic models, and the sampling settings
they ask for.

Fields follow OpenAI's API reference; ``top_k`` and ``ignore_eos`` are extras (as vLLM has
them). Fields that only bookkeep (``user``, ``metadata``...) are accepted and ignored; fields
that would change the answer in a way this server cannot honour (``echo``, ``logit_bias``,
penalties, tools...) are refused by name rather than silently ignored.

Every number has bounds (those of :class:`~levanter_core.inference.sampling.SamplingParams`,
which the engine checks again), and every text that reaches the tokenizer must be Unicode
text: a lone UTF-16 surrogate (JSON's ``"\\ud800"``) is refused by name, as is a value out of
range, so that no client mistake reaches the engine.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from levanter_core.inference.sampling import (
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    SEED_RANGE,
    SamplingParams,
)

COMPLETIONS_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions`` (chat's default is the rest of the context)."""

MAX_TOKENS = 2**31 - 1
"""The largest ``max_tokens`` a request may name (the context, checked later, is smaller still)."""


_SURROGATE = re.compile("[\ud800-\udfff]")

MAX_SAMPLES = 128
"""The most answers (``n``) one request may ask for per prompt."""


def _unicode(text: str, what: str) -> str:
    """``text``, if it is Unicode text: JSON can carry a lone UTF-16 surrogate (``"\\ud800"``),
    which no tokenizer can encode and no answer can echo."""
    found = _SURROGATE.search(text)
    if found:
        raise PydanticCustomError(
            "unicode",
            "{what} holds a lone UTF-16 surrogate (U+{code}) at character {at}, which is not Unicode "
            "text: send each character whole (a surrogate pair in JSON is one character)",
            {"what": what, "code": f"{ord(found.group()):04X}", "at": found.start()},
        )
    return text


def _prompt(value: Any) -> Any:
    def ids(v):
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str):
        return _unicode(value, "the prompt")
    if ids(value):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [_unicode(v, f"prompt[{i}]") for i, v in enumerate(value)]
    if isinstance(value, list) and value and all(ids(v) for v in value):
        return value
    raise PydanticCustomError(
        "prompt", "should be a string, a list of strings, a list of token ids or a list of lists of token ids"
    )


def _stop(value: Any) -> Any:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise PydanticCustomError("stop", "should be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        counts = {"most": MAX_STOP_STRINGS, "n": len(stops)}
        raise PydanticCustomError("stop", "takes at most {most} strings, not {n}", counts)
    for i, s in enumerate(stops):
        if not s:
            raise PydanticCustomError("stop", "a stop string must not be empty")
        if len(s) > MAX_STOP_LENGTH:
            why = "a stop string may have at most {most} characters, not {n}"
            raise PydanticCustomError("stop", why, {"most": MAX_STOP_LENGTH, "n": len(s)})
        _unicode(s, f"stop string {i}")
    return tuple(stops)


def _content(value: Any) -> Any:
    # OpenAI's content parts: only text can reach a text model
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise PydanticCustomError(
                    "content",
                    'should be a string or a list of text parts ({"type": "text", "text": ...}); '
                    "found a part of type {kind}",
                    {"kind": json.dumps(kind)},
                )
        value = "".join(part["text"] for part in value)
    if not isinstance(value, str):
        raise PydanticCustomError("content", "should be a string or a list of text parts")
    return _unicode(value, "the content")


Prompt = Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_prompt)]
Stop = Annotated[tuple[str, ...], BeforeValidator(_stop)]
Content = Annotated[str, BeforeValidator(_content)]

# Accepted only at the value that means "off" (any other value is refused: it would change the
# answer in a way this server does not implement).
_OFF_ONLY: dict[str, tuple] = {
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    include_usage: bool = False
    """End the stream with a chunk that holds the request's ``usage`` (and no choices)."""


class _GenerationRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    """The served model's name (``/v1/models``); another name is refused with 404. Optional."""

    @field_validator("model", mode="after")
    @classmethod
    def _model_text(cls, value):
        return value if value is None else _unicode(value, "the model's name")

    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    """Softmax temperature, 0 (greedy) to 100. Default 1."""
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    """Nucleus sampling: keep the most likely tokens whose probabilities add up to ``top_p``,
    in (0, 1]. Default 1."""
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    """Extra: sample among the ``top_k`` most likely tokens (at most 2**31 - 1; past the
    vocabulary's size: all); 0 or -1 (the default): all."""
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    """Answers per prompt."""
    stream: bool = False
    """Send the answer as it is generated, as server-sent events."""
    stream_options: StreamOptions | None = None
    stop: Stop = ()
    """Strings that end the answer where they appear (not part of it)."""
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    """The same seed gives the same answer, a different one (any signed 64-bit integer) a
    different one; default: a fresh random seed per request."""
    ignore_eos: bool = False
    """Extra: keep generating past the end-of-sequence token (for benchmarks)."""

    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list | None = None
    functions: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None

    @field_validator(*_OFF_ONLY, mode="after", check_fields=False)
    @classmethod
    def _refuse(cls, value, info):
        if value not in _OFF_ONLY[info.field_name]:
            why = "is not supported by this server (leave it out, or at {off})"
            raise PydanticCustomError("unsupported", why, {"off": _off(info.field_name)})
        return value

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        """The engine's settings for this request, generating at most ``max_new_tokens``."""
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=secrets.randbits(63) if self.seed is None else self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            top_logprobs=self.alternatives,
        )

    @property
    def alternatives(self) -> int:
        """How many of the most likely tokens to report at each position (0: none)."""
        return 0

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _off(name: str) -> str:
    return json.dumps(next(v for v in _OFF_ONLY[name] if v is not None))


class CompletionRequest(_GenerationRequest):
    """The body of ``POST /v1/completions``."""

    prompt: Prompt
    """A text, several texts, a list of token ids, or several such lists: one answer (``n``) each."""
    max_tokens: int | None = Field(COMPLETIONS_MAX_TOKENS, ge=1, le=MAX_TOKENS)
    """Most tokens to generate for each answer (default 16, as OpenAI)."""
    logprobs: int | None = Field(None, ge=0, le=5)
    """Return the log-probability of each generated token and of the ``logprobs`` most likely
    tokens at its position (0: the chosen token's only)."""
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def alternatives(self) -> int:
        return self.logprobs or 0


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content
    """The text, or a list of text parts (joined)."""
    name: str | None = None

    @field_validator("name", mode="after")
    @classmethod
    def _name_text(cls, value):
        return value if value is None else _unicode(value, "the name")

    def as_template_message(self) -> dict:
        """The ``{"role", "content"}`` a chat template renders (``developer`` is OpenAI's newer
        name for ``system``, which is the one templates know)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(_GenerationRequest):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    """Most tokens to generate for each answer; default: as many as the context has room for."""
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    """OpenAI's newer name for ``max_tokens`` (it wins when both are given)."""
    logprobs: bool = False
    """Return the log-probability of each generated token."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """With ``logprobs``: also the ``top_logprobs`` most likely tokens at each position."""

    @property
    def max_tokens_field(self) -> str:
        """The name of the field that set the token budget (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def alternatives(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
