"""A tiny model to serve, and real servers over it: uvicorn on a free loopback port, in a
thread, shared by the tests of a session. Nothing is downloaded: the model is a random
``transformers`` Llama and the tokenizer a byte-level BPE trained here on a few sentences."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from levanter_core.hf.parity import random_hf_model

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SENTENCES * 4, trainer)
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
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


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def loaded(model_dir):
    from levanter_core.models.source import load_model_source

    return load_model_source(model_dir)


def started_engine(loaded, **settings):
    """An engine over ``loaded`` with its first steps compiled."""
    from levanter_core.inference.engine import Engine
    from levanter_serve.server import warm_up

    engine = Engine(loaded.model, tokenizer=loaded.tokenizer, eos_ids=loaded.eos_ids, **settings)
    warm_up(engine)
    return engine


@pytest.fixture(scope="session")
def engine(loaded):
    engine = started_engine(loaded)
    yield engine
    engine.shutdown(drain=False)


@pytest.fixture(scope="session")
def server(engine, loaded):
    """The URL of a server without an API key."""
    from levanter_serve import create_app

    with ServerThread(create_app(engine, loaded)) as running:
        yield running.url


@pytest.fixture(scope="session")
def keyed_server(engine, loaded):
    """The URL of a server over the same engine that wants the API key ``sesame``."""
    from levanter_serve import create_app

    with ServerThread(create_app(engine, loaded, api_key="sesame", model_name="tiny-keyed")) as running:
        yield running.url


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
