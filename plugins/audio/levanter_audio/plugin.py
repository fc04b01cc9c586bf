"""Entry point of levanter-audio: registers the ``audio`` data format. Imports nothing of the
format itself (nor soundfile), so that every ``levanter`` command stays quick to start."""

from levanter_core.plugins import hookimpl


@hookimpl
def register_data_formats(register):
    register("audio", "levanter_audio.format:AudioFormat")
