"""Entry point of the Whisper plugin: registers ``type: whisper`` and claims Hugging Face's
``whisper`` checkpoints. Imports nothing of the model: every ``levanter`` command loads it."""

from levanter_core.plugins import hookimpl


@hookimpl
def register_models(register):
    register("whisper", "levanter_model_whisper.whisper:WhisperConfig")


@hookimpl
def model_type_for_hf_config(hf_config):
    if hf_config.get("model_type") == "whisper":
        return "whisper"
    return None
