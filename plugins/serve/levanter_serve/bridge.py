"""The engine's requests seen from an asyncio event loop.

:class:`~levanter_core.inference.engine.Engine` runs on a thread of its own and reports each
request's progress through an ``on_update`` callback called on that thread. A
:class:`Generation` hands those updates to the event loop with ``call_soon_threadsafe``, so
that a request handler awaits them without ever blocking the loop (no thread waits in
``Request.result()``, however many requests are in flight).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from levanter_core.inference.engine import Completion, Engine, Request, Update
from levanter_core.inference.sampling import SamplingParams

POLL_SECONDS = 0.5
"""How often a generation with no news asks whether its client is still there."""


class Generation:
    """The engine requests of one HTTP request (its prompts times ``n``), each known by its
    choice number, with their updates merged into one stream on the event loop.

    Create it on the event loop's thread (it binds to the running loop); :meth:`submit`
    every request, then read :meth:`updates` or await :meth:`completions`."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._updates: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()
        self._requests: dict[int, Request] = {}
        self._finished: dict[int, Completion] = {}

    def submit(self, choice: int, prompt: list[int], params: SamplingParams, *, sample: int = 0) -> None:
        """Queue ``prompt`` in the engine as choice ``choice`` (``sample``: its number among the
        prompt's ``n``, which seeds its random draws). Raises the engine's ``RequestError``
        (400, 429, 503); the caller then cancels what it submitted."""

        def on_update(update: Update) -> None:  # on the engine's thread
            try:
                self._loop.call_soon_threadsafe(self._updates.put_nowait, (choice, update))
            except RuntimeError:  # the event loop has closed (a server stopped at once): nobody listens
                if choice in self._requests:
                    self._requests[choice].cancel()

        self._requests[choice] = self._engine.submit(prompt, params, index=sample, on_update=on_update)

    def cancel(self) -> None:
        """Stop every request that has not ended (its client went away); their slots free at
        the engine's next step."""
        for choice, request in self._requests.items():
            if choice not in self._finished:
                request.cancel()

    async def updates(
        self, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[tuple[int, Update]]:
        """``(choice, update)`` as the engine produces them, until every request has ended.
        Raises the engine's ``RequestError`` (503) if it fails. With ``is_disconnected``, a client
        that went away cancels the requests and ends the stream early."""
        while len(self._finished) < len(self._requests):
            try:
                choice, update = await asyncio.wait_for(self._updates.get(), POLL_SECONDS)
            except TimeoutError:
                if is_disconnected is not None and await is_disconnected():
                    self.cancel()
                    return
                continue
            if update.error is not None:  # the engine failed: every request of it ends so
                raise update.error
            if update.finished is not None:
                self._finished[choice] = update.finished
            yield choice, update

    async def completions(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> dict[int, Completion]:
        """Every request's completion by choice, once all have ended (``is_disconnected`` as
        for :meth:`updates`: the dict then lacks the requests that were cancelled)."""
        async for _ in self.updates(is_disconnected):
            pass
        return dict(self._finished)
