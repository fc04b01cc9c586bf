"""Running the application: load a SOURCE, start its engine, serve HTTP with uvicorn until
Ctrl-C (or SIGTERM), then finish what is in flight and stop."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time

import uvicorn

from levanter_core.errors import LevanterError, UserError
from levanter_core.inference.engine import Engine
from levanter_core.inference.sampling import SamplingParams
from levanter_core.models.source import load_model_source
from levanter_serve.app import create_app
from levanter_serve.defaults import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PORT,
)
from levanter_serve.limits import protocol_with_header_timeout

logger = logging.getLogger(__name__)


class EngineFailed(LevanterError):
    """The inference engine stopped (see :class:`~levanter_core.inference.engine.Engine`): the
    server stops too, and the command exits with status 1, for a supervisor to restart it."""


def serve(
    source: str,
    *,
    tokenizer: str | None = None,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    model_name: str | None = None,
    max_seqs: int = 16,
    max_queued: int = 256,
    max_seq_len: int | None = None,
    max_rounds: int = 4,
    precompile: bool = False,
    allowed_hosts: tuple[str, ...] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    public_docs: bool = False,
) -> None:
    """Serve the model of ``source`` (a checkpoint, an import, a Hugging Face directory or hub
    name; ``tokenizer`` replaces its own) on ``host``:``port`` until SIGINT or SIGTERM.

    The port is taken before the model loads (a busy port fails at once). The engine decodes
    ``max_seqs`` sequences together, ``max_rounds`` tokens per step, and holds ``max_queued``
    more requests waiting (one more is answered 429); prompt and answer must fit in
    ``max_seq_len`` tokens (default and at most the model's ``seq_len``). On a signal, uvicorn
    stops accepting connections and waits for the answers in progress, then the engine
    finishes whatever it still holds: every accepted request gets its whole answer. A second
    signal stops at once. ``precompile``: compile every shape the engine can meet before
    listening (see :meth:`Engine.precompile`), rather than only the smallest.

    What clients may send: ``allowed_hosts``, ``max_body_bytes``, ``body_timeout`` and
    ``public_docs`` as :func:`~levanter_serve.app.create_app` takes them; ``header_timeout``
    seconds for each request's line and headers. If the engine fails (not one request: the
    engine), the server stops taking requests, answers those in flight with 503, and raises
    :class:`EngineFailed`."""
    listener = _listen(host, port)
    try:
        loaded = load_model_source(source, tokenizer=tokenizer)
        seq_len = loaded.config.seq_len
        if max_seq_len is not None and max_seq_len > seq_len:
            raise UserError(f"--max-seq-len {max_seq_len} is longer than the model's context ({seq_len} tokens)")
        engine = Engine(
            loaded.model,
            tokenizer=loaded.tokenizer,
            eos_ids=loaded.eos_ids,
            max_seqs=max_seqs,
            max_seq_len=max_seq_len,
            max_queued=max_queued,
            max_rounds=max_rounds,
        )
        app = create_app(
            engine, loaded, api_key=api_key, model_name=model_name, allowed_hosts=allowed_hosts,
            max_body_bytes=max_body_bytes, body_timeout=body_timeout, public_docs=public_docs,
        )  # fmt: skip
        if precompile:
            started = time.perf_counter()
            print("compiling every shape the engine can meet (--precompile)", flush=True)
            count = engine.precompile()
            print(f"compiled {count} programs in {time.perf_counter() - started:.1f} s", flush=True)
        warm_up(engine)
        listener.listen(2048)  # connections wait in the backlog from now on, until uvicorn accepts them
        name = model_name or loaded.name
        port = listener.getsockname()[1]  # the one the system chose for --port 0
        print(
            f"serving {name} ({engine.max_seq_len} tokens of context) at http://{_url_host(host)}:{port}/v1"
            f"{' (API key required)' if api_key else ''}; Ctrl-C to stop",
            flush=True,
        )
        run_until_stopped(engine, app, listener, header_timeout=header_timeout)
    finally:
        listener.close()


def run_until_stopped(engine, app, listener: socket.socket, *, header_timeout: float = DEFAULT_HEADER_TIMEOUT) -> None:
    """Serve ``app`` (over ``engine``) with uvicorn on ``listener`` until SIGINT or SIGTERM, then
    let the engine finish what it holds. If the engine fails, stop and raise :class:`EngineFailed`."""
    server = uvicorn.Server(uvicorn_config(app, header_timeout=header_timeout, log_level="info"))
    engine.on_failure = lambda error: stop_when_engine_fails(server, error)
    try:
        with _signals_end_quietly():
            server.run(sockets=[listener])
        if engine.failed is not None:
            raise EngineFailed(f"the inference engine failed, so the server stopped: {engine.failed}")
    finally:
        # uvicorn has waited for every answer in progress, unless a second Ctrl-C cut it short
        drain = not server.force_exit
        pending = engine.pending()
        if pending:
            what = "finishing" if drain else "cancelling"
            logger.warning("%s the %d requests still in the engine", what, pending)
        engine.shutdown(drain=drain)


def uvicorn_config(app, *, header_timeout: float = DEFAULT_HEADER_TIMEOUT, log_level: str = "info"):
    """uvicorn's settings for serving ``app``: HTTP/1.1 with a deadline of ``header_timeout``
    seconds on each request's head (see :class:`~levanter_serve.limits.HeaderTimeoutProtocol`)."""
    return uvicorn.Config(
        app, lifespan="off", log_level=log_level, timeout_graceful_shutdown=None,
        http=protocol_with_header_timeout(header_timeout),
    )  # fmt: skip


def stop_when_engine_fails(server, error: BaseException) -> None:
    """``Engine.on_failure`` of a server: log and stop the uvicorn ``server`` (its requests in
    flight have already been failed, with 503)."""
    logger.error("the inference engine failed (%s): stopping the server", error)
    server.should_exit = True


def warm_up(engine) -> None:
    """Compile the engine's smallest prefill and decoding step before the first request needs them."""
    logger.info("compiling the model's first steps")
    engine.start()
    engine.generate([[0]], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (uvicorn listens on it once the model is ready)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UserError(f"--host {host!r}: not an address this machine can listen on ({e})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}): choose another --port or --host") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@contextlib.contextmanager
def _signals_end_quietly():
    """uvicorn shuts down gracefully on SIGINT and SIGTERM, then raises the signal again through
    the handler that was there before it, which would end the command as interrupted (exit 130,
    or killed by SIGTERM) after a clean drain. Put a handler that does nothing there instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda *_: None) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
