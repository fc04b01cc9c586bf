"""The OpenAI request bodies this server reads, as pydantic models, and the sampling settings
they ask for.

Fields follow OpenAI's API reference; ``top_k`` and ``ignore_eos`` are extras (as vLLM has
them). Fields that only bookkeep (``user``, ``metadata``...) are accepted and ignored; fields
that would change the answer in a way this server cannot honour (``echo``, ``logit_bias``,
penalties, tools...) are refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from levanter_core.inference.sampling import SamplingParams

COMPLETIONS_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions`` (chat's default is the rest of the context)."""


def _prompt(value: Any) -> Any:
    def ids(v):
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str) or ids(value):
        return value
    if isinstance(value, list) and value and (all(isinstance(v, str) for v in value) or all(ids(v) for v in value)):
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
    if any(not s for s in stops):
        raise PydanticCustomError("stop", "a stop string must not be empty")
    return tuple(stops)


def _content(value: Any) -> Any:
    # OpenAI's content parts: only text can reach a text model
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise PydanticCustomError(
                    "content",
                    "should be a string or a list of text parts ({\"type\": \"text\", \"text\": ...}); "
                    "found a part of type {kind}",
                    {"kind": json.dumps(kind)},
                )
        return "".join(part["text"] for part in value)
    if not isinstance(value, str):
        raise PydanticCustomError("content", "should be a string or a list of text parts")
    return value


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
    temperature: float | None = Field(None, ge=0)
    """Softmax temperature; 0 is greedy. Default 1."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling: keep the most likely tokens whose probabilities add up to ``top_p``. Default 1."""
    top_k: int | None = Field(None, ge=-1)
    """Extra: sample among the ``top_k`` most likely tokens; 0 or -1 (the default): all."""
    n: int = Field(1, ge=1, le=128)
    """Answers per prompt."""
    stream: bool = False
    """Send the answer as it is generated, as server-sent events."""
    stream_options: StreamOptions | None = None
    stop: Stop = ()
    """Strings that end the answer where they appear (not part of it)."""
    seed: int | None = None
    """The same seed gives the same answer; default: a fresh random seed per request."""
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
            seed=secrets.randbits(32) if self.seed is None else self.seed,
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
    max_tokens: int | None = Field(COMPLETIONS_MAX_TOKENS, ge=1)
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

    def as_template_message(self) -> dict:
        """The ``{"role", "content"}`` a chat template renders (``developer`` is OpenAI's newer
        name for ``system``, which is the one templates know)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(_GenerationRequest):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    """Most tokens to generate for each answer; default: as many as the context has room for."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for ``max_tokens`` (it wins when both are given)."""
    logprobs: bool = False
    """Return the log-probability of each generated token."""
    top_logprobs: int | None = Field(None, ge=0, le=20)
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
