"""Entry point of the Whisper plugin: registers ``type: whisper``, its training objective
``asr``, the ``levanter transcribe`` command, and claims Hugging Face's ``whisper`` checkpoints.
Imports nothing of the model: every ``levanter`` command loads it (the command's module imports
only typer until it runs)."""

from levanter_core.plugins import hookimpl


@hookimpl
def register_models(register):
    register("whisper", "levanter_model_whisper.whisper:WhisperConfig")


@hookimpl
def register_objectives(register):
    register("asr", "levanter_model_whisper.objective:SpeechRecognition")


@hookimpl
def register_commands(app):
    from levanter_model_whisper.cli import transcribe_command

    app.command("transcribe")(transcribe_command)


@hookimpl
def model_type_for_hf_config(hf_config):
    if hf_config.get("model_type") == "whisper":
        return "whisper"
    return None
