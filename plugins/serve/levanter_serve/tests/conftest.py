"""The tiny model (``tiny.py``) and real servers over it, shared by the tests of a session."""

from __future__ import annotations

import pytest

from levanter_serve.tests.tiny import ServerThread, make_tiny_model, started_engine


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def loaded(model_dir):
    from levanter_core.models.source import load_model_source

    return load_model_source(model_dir)


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
