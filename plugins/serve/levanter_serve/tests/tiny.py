"""A tiny model to serve and a way to serve it in tests: uvicorn on a free loopback port, in a
thread. Nothing is downloaded: the model is a random ``transformers`` Llama and the tokenizer a
byte-level BPE trained here on a few sentences."""

from __future__ import annotations

import os
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
    import transformers
    from tokenizers import Tokenizer

    from levanter_core.hf.parity import random_hf_model
    from levanter_core.testing import train_bpe_tokenizer

    os.makedirs(directory, exist_ok=True)
    path = train_bpe_tokenizer(SENTENCES * 4, os.path.join(directory, "tokenizer.json"), vocab_size=320)
    tokenizer = Tokenizer.from_file(path)
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    random_hf_model(config).save_pretrained(directory)
    return directory


class ServerThread:
    """uvicorn serving ``app`` on a free port of 127.0.0.1, in a thread (``with`` it)."""

    def __init__(self, app):
        import uvicorn

        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> "ServerThread":
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
