"""The server's defaults, in a module that imports nothing: the plugin's entry point reads them
for ``levanter serve --help`` without loading FastAPI, uvicorn or JAX (which every other
``levanter`` command would then pay for)."""

DEFAULT_HOST = "127.0.0.1"
"""Where the server listens by default: this machine only."""

DEFAULT_PORT = 8000

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
"""The largest request body by default (8 MiB: room for a batch of long prompts)."""

DEFAULT_HEADER_TIMEOUT = 10.0
"""Seconds a client has by default to send a request's line and headers."""

DEFAULT_BODY_TIMEOUT = 30.0
"""Seconds a client has by default to send a request's body, once its headers are in."""
