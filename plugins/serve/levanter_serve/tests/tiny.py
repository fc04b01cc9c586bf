"""A tiny model to serve and a way to serve it in tests: uvicorn on a free loopback port, in a
thread. Nothing is downloaded: the model is a random ``transformers`` Llama and the tokenizer a
byte-level BPE trained here on a few sentences."""

from __future__ import annotations

import socket
import threading
import time

CONTEXT = 256
"""The tiny model's context (``max_position_embeddings``), which the error messages name."""

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you today?",
    "language models predict the next token from the ones before it",
    "a server answers many requests at once by batching them together",
]


def make_tiny_model(directory: str) -> str:
    """A random two-layer Llama and its tokenizer.json, saved as a Hugging Face model directory."""
    from levanter_core.testing import tiny_hf_llama

    return tiny_hf_llama(directory, SENTENCES * 4, vocab_size=320, context=CONTEXT)


class ServerThread:
    """uvicorn serving ``app`` on a free port of 127.0.0.1, in a thread (``with`` it), with the
    settings ``levanter serve`` gives it (``header_timeout``: see ``server.uvicorn_config``)."""

    def __init__(self, app, **settings):
        import uvicorn

        from levanter_serve.server import uvicorn_config

        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, log_level="warning", **settings))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()


def started_engine(loaded, **settings):
    """An engine over ``loaded`` with its first steps compiled."""
    from levanter_core.inference.engine import Engine
    from levanter_serve.server import warm_up

    engine = Engine(loaded.model, tokenizer=loaded.tokenizer, eos_ids=loaded.eos_ids, **settings)
    warm_up(engine)
    return engine
