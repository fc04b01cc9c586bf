"""``levanter serve``: an OpenAI-compatible HTTP server over levanter-core's inference engine.

:func:`create_app` builds the FastAPI application over a running engine (tests and other
servers mount it themselves); :func:`serve` loads a model and runs it with uvicorn. Both are
imported on first access, so that loading the plugin stays cheap."""

__all__ = ["create_app", "serve"]


def __getattr__(name: str):
    if name == "create_app":
        from levanter_serve.app import create_app

        return create_app
    if name == "serve":
        from levanter_serve.server import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
