"""Entry point of the serve plugin (see ``pyproject.toml``): adds ``levanter serve``.

FastAPI, uvicorn and JAX are imported when the command runs, so that loading the plugin
(which every ``levanter`` command does) stays cheap."""

from __future__ import annotations

from typing import Annotated

import typer

from levanter_core.plugins import hookimpl
from levanter_core.plugins.commands import SOURCE_HELP
from levanter_serve.defaults import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_HOST, DEFAULT_PORT


def serve_command(
    source: Annotated[
        str,
        typer.Argument(
            help=SOURCE_HELP,
            metavar="SOURCE",
        ),
    ],
    host: Annotated[
        str, typer.Option(help="Address to listen on; 0.0.0.0 to accept connections from other machines.")
    ] = DEFAULT_HOST,
    port: Annotated[int, typer.Option(help="Port to listen on.", min=0, max=65535)] = DEFAULT_PORT,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="LEVANTER_API_KEY",
            show_envvar=True,
            help="Answer 401 to /v1 requests without the header 'Authorization: Bearer <key>'.",
        ),
    ] = None,
    model_name: Annotated[
        str | None,
        typer.Option(help="The model's name in /v1/models and in answers (default: SOURCE's last path component)."),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="Tokenizer to use instead of SOURCE's own: a tokenizer.json, its directory, or a hub name."),
    ] = None,
    max_seqs: Annotated[
        int,
        typer.Option(help="Sequences decoded together (the batch; each holds a row of the key/value cache).", min=1),
    ] = 16,
    max_queued: Annotated[
        int, typer.Option(help="Requests that may wait for a free sequence; one more is answered 429.", min=0)
    ] = 256,
    max_seq_len: Annotated[
        int | None,
        typer.Option(
            help="Tokens of prompt plus answer per sequence (default and at most the model's seq_len).", min=2
        ),
    ] = None,
    max_rounds: Annotated[
        int, typer.Option(help="Tokens each sequence generates per engine step before new requests may join.", min=1)
    ] = 4,
    precompile: Annotated[
        bool,
        typer.Option(
            help="Compile every prompt-length and batch shape before listening, so that no request waits "
            "on a compilation (a slower start); otherwise each shape compiles when a request first needs it."
        ),
    ] = False,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-host",
            help="Without --api-key, the server answers only requests whose Host header is an IP address, "
            "localhost, or a name given here (repeat for several; '*' for any), against DNS rebinding.",
            metavar="NAME",
        ),
    ] = None,
    max_body_size: Annotated[
        str, typer.Option(help="Largest request body, e.g. 8MiB or 500KB; a larger one is answered 413.")
    ] = "8MiB",
    header_timeout: Annotated[
        float,
        typer.Option(help="Seconds a client has to send a request's line and headers (then 408).", min=0.1, max=3600),
    ] = DEFAULT_HEADER_TIMEOUT,
    body_timeout: Annotated[
        float,
        typer.Option(help="Seconds a client has to send a request's body (then 408).", min=0.1, max=3600),
    ] = DEFAULT_BODY_TIMEOUT,
    public_docs: Annotated[
        bool,
        typer.Option(
            "--public-docs",
            help="With --api-key, serve /docs and /openapi.json without the key (they need it otherwise).",
        ),
    ] = False,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API.

    Endpoints: /v1/completions, /v1/chat/completions (both streaming or not), /v1/models,
    /health. Concurrent requests are batched together by the inference engine. Ctrl-C
    (or SIGTERM) stops taking connections and finishes the answers in progress first.
    """
    from levanter_core.config.types import parse_size
    from levanter_serve.server import serve

    try:
        max_body_bytes = parse_size(max_body_size)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="'--max-body-size'") from None
    if max_body_bytes < 1024:
        raise typer.BadParameter(f"{max_body_bytes} bytes is too small (at least 1KiB)", param_hint="'--max-body-size'")
    serve(
        source,
        tokenizer=tokenizer,
        host=host,
        port=port,
        api_key=api_key or None,
        model_name=model_name,
        max_seqs=max_seqs,
        max_queued=max_queued,
        max_seq_len=max_seq_len,
        max_rounds=max_rounds,
        precompile=precompile,
        allowed_hosts=tuple(allowed_host or ()),
        max_body_bytes=max_body_bytes,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        public_docs=public_docs,
    )


@hookimpl
def register_commands(app):
    app.command("serve")(serve_command)
