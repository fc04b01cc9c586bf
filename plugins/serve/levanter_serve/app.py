"""The HTTP application: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models``, and ``/health``, over one running :class:`~levanter_core.inference.engine.Engine`.

Each HTTP request becomes one engine request per prompt and sample (``n``); the engine
batches them with every other request in flight. Answers are sent whole, or (``stream``) as
server-sent events as the engine produces them.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from levanter_core.errors import DataError, UserError
from levanter_core.inference.engine import Completion, Engine, RequestError
from levanter_core.inference.sample import encode_prompts
from levanter_serve.bridge import Generation
from levanter_serve.errors import ApiError, install_error_handlers
from levanter_serve.limits import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    LOOPBACK_NAMES,
    HostAllowList,
    RequestGuard,
)
from levanter_serve.protocol import COMPLETIONS_MAX_TOKENS, ChatCompletionRequest, CompletionRequest

CLIENT_GONE = 499
"""The status logged for a request whose client left before its answer (nginx's convention)."""


def create_app(
    engine: Engine,
    loaded,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    allowed_hosts: tuple[str, ...] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    public_docs: bool = False,
) -> FastAPI:
    """The server's application over ``engine`` (started, or started by the first request),
    which runs ``loaded``'s model (a :class:`~levanter_core.models.source.LoadedModel`, whose
    tokenizer turns text into tokens and back). ``model_name`` (default ``loaded.name``) is the
    name ``/v1/models`` lists. With ``api_key``, every ``/v1`` request must carry
    ``Authorization: Bearer <api_key>`` (``/health`` stays open, for load balancers), and so
    must ``/docs`` and ``/openapi.json`` unless ``public_docs``.

    Without ``api_key``, only requests whose ``Host`` is an IP address, a loopback name or one
    of ``allowed_hosts`` (``"*"``: any) are answered (see :mod:`levanter_serve.limits`). A body
    over ``max_body_bytes`` is refused with 413, one that takes longer than ``body_timeout``
    seconds to arrive with 408."""
    if loaded.tokenizer is None:
        raise UserError(f"{loaded.source} has no tokenizer (no tokenizer.json): name one with --tokenizer")
    server = _Server(engine, loaded.tokenizer, model_name or loaded.name)
    checks = [Depends(_bearer(api_key))] if api_key else []
    private_docs = bool(api_key) and not public_docs
    app = FastAPI(
        title="levanter serve",
        summary=f"OpenAI-compatible API over {server.model_name}",
        **({"docs_url": None, "redoc_url": None, "openapi_url": None} if private_docs else {}),
    )
    install_error_handlers(app)
    hosts = None if api_key else HostAllowList((*LOOPBACK_NAMES, *allowed_hosts))
    app.add_middleware(RequestGuard, allowed_hosts=hosts, max_body_bytes=max_body_bytes, body_timeout=body_timeout)
    if private_docs:
        _add_private_docs(app, checks)

    @app.get("/health")
    async def health():
        """``{"status": "ok"}`` while the engine takes requests; 503 once it is shutting down or has failed."""
        trouble = engine.refusal()
        if trouble:
            raise ApiError(503, f"the engine is not taking requests: {trouble}", code="engine_unavailable")
        return {"status": "ok", "model": server.model_name, "pending": engine.pending()}

    @app.get("/v1/models", dependencies=checks)
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=checks)
    async def model(model: str):
        server.check_model(model)
        return server.model_card()

    @app.post("/v1/completions", dependencies=checks)
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions", dependencies=checks)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat_completions(body, request)

    return app


def _add_private_docs(app: FastAPI, checks: list) -> None:
    """``/openapi.json`` and ``/docs`` (Swagger UI) behind the API key's check ``checks``."""

    @app.get("/openapi.json", dependencies=checks, include_in_schema=False)
    async def openapi():
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=checks, include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")


def _bearer(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):  # in constant time: no guessing key prefixes
            what = "no API key was given" if not given else "the API key is wrong"
            message = f"{what}: send the server's key as the header 'Authorization: Bearer <key>'"
            raise ApiError(401, message, code="invalid_api_key")

    return check


class _Server:
    """What the routes share: the engine, the tokenizer, the model's name."""

    def __init__(self, engine: Engine, tokenizer, model_name: str):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "levanter",
            "max_model_len": self.engine.max_seq_len,
        }

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist: this server serves {self.model_name!r} (see /v1/models)",
                param="model",
                code="model_not_found",
            )

    # -- the two endpoints ---------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        prompts = self._prompts(body.prompt)
        budget = body.max_tokens or COMPLETIONS_MAX_TOKENS
        generation = self._submit(prompts, body, lambda prompt: budget, "prompt", "max_tokens")
        logprobs = None if body.logprobs is None else _Logprobs(self.tokenizer, chat=False, top=body.logprobs)
        reply = _Reply("cmpl", "text_completion", self.model_name, sum(map(len, prompts)), logprobs)
        if body.stream:
            return _sse(generation, reply.stream_completion(generation, request, body.include_usage))
        finished = await generation.completions(request.is_disconnected)
        if len(finished) < len(prompts) * body.n:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(reply.completion(finished))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        messages = [m.as_template_message() for m in body.messages]
        try:
            (prompt,) = encode_prompts([{"messages": messages, "where": "messages"}], self.tokenizer, chat=True)
        except DataError as e:  # the chat template refused the conversation
            raise ApiError(400, str(e), param="messages") from None
        limit = self.engine.max_seq_len
        budget = body.token_budget
        # no budget given: whatever room the context leaves (at least 1, so that a prompt too
        # long for the context is what the engine complains about)
        generation = self._submit(
            [prompt], body, lambda p: budget or max(1, limit - len(p)), "messages", body.max_tokens_field
        )
        logprobs = _Logprobs(self.tokenizer, chat=True, top=body.top_logprobs or 0) if body.logprobs else None
        reply = _Reply("chatcmpl", "chat.completion", self.model_name, len(prompt), logprobs)
        if body.stream:
            return _sse(generation, reply.stream_chat(generation, request, body.include_usage))
        finished = await generation.completions(request.is_disconnected)
        if len(finished) < body.n:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(reply.chat(finished))

    # -- turning a request into engine requests ------------------------------------------------
    def _prompts(self, prompt) -> list[list[int]]:
        """The token ids of each prompt of a completions request (see ``CompletionRequest.prompt``)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt or isinstance(prompt[0], int):  # one prompt of token ids
            return [list(prompt)]
        if isinstance(prompt[0], str):
            return encode_prompts([{"prompt": text} for text in prompt], self.tokenizer, chat=False)
        return [list(p) for p in prompt]

    def _submit(self, prompts, body, budget_of, prompt_field: str, budget_field: str) -> Generation:
        """Queue ``n`` samples of every prompt (generating at most ``budget_of(prompt)`` tokens);
        choice ``p * n + i`` is sample ``i`` of prompt ``p`` (OpenAI's order). Every prompt is
        checked before any is queued; a refusal of the queue cancels what was already queued.
        ``prompt_field`` and ``budget_field`` name the fields a too-long request is blamed on."""
        planned = []
        for prompt in prompts:
            budget = budget_of(prompt)
            params = body.sampling(budget)
            try:
                self.engine.check(prompt, params)
            except RequestError as e:
                limit = self.engine.max_seq_len
                too_long = bool(prompt) and len(prompt) + budget > limit
                param = {"prompt": prompt_field, "max_new_tokens": budget_field}.get(e.field, e.field)
                if param == "top_logprobs" and prompt_field == "prompt":
                    param = "logprobs"  # what /v1/completions calls it
                code = "context_length_exceeded" if too_long and e.field in ("prompt", "max_new_tokens") else None
                raise ApiError.from_engine(e, param=param, code=code) from None
            planned.append((prompt, params))
        generation = Generation(self.engine)
        try:
            for p, (prompt, params) in enumerate(planned):
                for i in range(body.n):
                    generation.submit(p * body.n + i, prompt, params, sample=i)
        except RequestError as e:  # the queue is full, or the engine is shutting down
            generation.cancel()
            raise ApiError.from_engine(e) from None
        return generation


class _Logprobs:
    """The ``logprobs`` of a request's choices, in the shape its endpoint uses, built piece by
    piece as tokens arrive (the legacy completions shape gives each token's offset in the text,
    which runs on from one piece to the next)."""

    def __init__(self, tokenizer, *, chat: bool, top: int):
        self.tokenizer = tokenizer
        self.chat = chat
        self.top = top
        self._offsets: dict[int, int] = {}

    def __call__(self, choice: int, tokens: list[int], logprobs: list[float], tops: list) -> dict:
        """``tops``: the engine's alternatives at each token, ``[(token, logprob), ...]`` (empty
        when the request asked for none)."""
        texts = [self.tokenizer.decode([t]) for t in tokens]
        tops = tops or [[] for _ in tokens]
        if self.chat:
            content = []
            for text, lp, top in zip(texts, logprobs, tops):
                alternatives = [self._entry(self.tokenizer.decode([t]), a) for t, a in top]
                content.append({**self._entry(text, lp), "top_logprobs": alternatives})
            return {"content": content}
        offsets, offset = [], self._offsets.get(choice, 0)
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        self._offsets[choice] = offset
        return {
            "tokens": texts,
            "token_logprobs": list(logprobs),
            # keyed by text: tokens that decode alike keep the likelier one's value (OpenAI's shape)
            "top_logprobs": [self._by_text(top) for top in tops] if self.top else None,
            "text_offset": offsets,
        }

    @staticmethod
    def _entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _by_text(self, top: list[tuple[int, float]]) -> dict[str, float]:
        found: dict[str, float] = {}
        for token, logprob in top:
            found.setdefault(self.tokenizer.decode([token]), logprob)
        return found


class _Reply:
    """The response bodies of one request (whole or streamed), which share its id and time."""

    def __init__(self, prefix: str, kind: str, model: str, prompt_tokens: int, logprobs: _Logprobs | None):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.kind = kind
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs  # None unless the request asks for them

    def _head(self, kind: str | None = None) -> dict:
        return {"id": self.id, "object": kind or self.kind, "created": self.created, "model": self.model}

    def usage(self, finished: dict[int, Completion]) -> dict:
        completion_tokens = sum(len(c.tokens) for c in finished.values())
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def _logprobs_of(self, choice: int, tokens: list[int], logprobs: list[float], tops):
        return None if self.logprobs is None else self.logprobs(choice, tokens, logprobs, tops)

    def completion(self, finished: dict[int, Completion]) -> dict:
        choices = [
            {
                "index": i,
                "text": c.text,
                "logprobs": self._logprobs_of(i, c.tokens, c.logprobs, c.top_logprobs),
                "finish_reason": _reason(c),
            }
            for i, c in sorted(finished.items())
        ]
        return {**self._head(), "choices": choices, "usage": self.usage(finished)}

    def chat(self, finished: dict[int, Completion]) -> dict:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs_of(i, c.tokens, c.logprobs, c.top_logprobs),
                "finish_reason": _reason(c),
            }
            for i, c in sorted(finished.items())
        ]
        return {**self._head(), "choices": choices, "usage": self.usage(finished)}

    # -- streams -------------------------------------------------------------------------------
    async def stream_completion(self, generation: Generation, request: Request, include_usage: bool):
        head = self._head()

        def body(choice: int, text: str, done: Completion | None) -> dict:
            return {"index": choice, "text": text}

        async for chunk in self._stream(generation, request, include_usage, head, body, None):
            yield chunk

    async def stream_chat(self, generation: Generation, request: Request, include_usage: bool):
        head = self._head("chat.completion.chunk")

        def body(choice: int, text: str, done: Completion | None) -> dict:
            return {"index": choice, "delta": {"content": text} if text or done is None else {}}

        def opening(choice: int) -> dict:  # OpenAI opens each choice with its role
            return {"index": choice, "delta": {"role": "assistant", "content": ""}}

        async for chunk in self._stream(generation, request, include_usage, head, body, opening):
            yield chunk

    async def _stream(self, generation: Generation, request: Request, include_usage: bool, head, body, opening):
        """The chunks of a streamed answer: ``body(choice, text, finished)`` makes each choice's
        part (its text or delta), ``opening(choice)``, when given, a first chunk per choice.
        Tokens past a stop string can have been sent before the stop string showed; the last
        update trims what has not been sent yet to the completion's tokens."""
        finished: dict[int, Completion] = {}
        sent: dict[int, int] = {}
        async for choice, update in generation.updates(request.is_disconnected):
            done = update.finished
            if opening is not None and choice not in sent:
                yield self._chunk(head, {**opening(choice), "logprobs": None, "finish_reason": None}, include_usage)
            tokens, logprobs, tops = update.tokens, update.logprobs, update.top_logprobs
            if done is not None:
                finished[choice] = done
                room = max(0, len(done.tokens) - sent.get(choice, 0))
                tokens, logprobs, tops = tokens[:room], logprobs[:room], tops[:room]
            sent[choice] = sent.get(choice, 0) + len(tokens)
            if not update.text and done is None and not (self.logprobs and tokens):
                continue
            choice_body = {
                **body(choice, update.text, done),
                "logprobs": self._logprobs_of(choice, tokens, logprobs, tops),
                "finish_reason": None if done is None else _reason(done),
            }
            yield self._chunk(head, choice_body, include_usage)
        if include_usage:
            yield {**head, "choices": [], "usage": self.usage(finished)}

    @staticmethod
    def _chunk(head: dict, choice: dict, include_usage: bool) -> dict:
        chunk = {**head, "choices": [choice]}
        if include_usage:  # OpenAI: null on every chunk but the last
            chunk["usage"] = None
        return chunk


def _reason(c: Completion) -> str:
    return "length" if c.finish_reason == "length" else "stop"


def _sse(generation: Generation, chunks: AsyncIterator[dict]) -> StreamingResponse:
    """``chunks`` as server-sent events, ending with ``data: [DONE]``. A client that goes
    away cancels its requests (the generator's ``finally`` when it is closed mid-stream, the
    background task when the server notices the disconnection)."""

    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except RequestError as e:  # the engine failed mid-answer: the status line is long gone
            yield f"data: {json.dumps(ApiError.from_engine(e).body())}\n\n"
        finally:
            generation.cancel()
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(generation.cancel),
    )
