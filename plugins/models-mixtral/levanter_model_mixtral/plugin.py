"""Entry point of the Mixtral plugin: registers ``type: mixtral``."""

from levanter_core.plugins import hookimpl


@hookimpl
def register_models(register):
    register("mixtral", "levanter_model_mixtral.mixtral:MixtralConfig")


@hookimpl
def model_type_for_hf_config(hf_config):
    return "mixtral" if hf_config.get("model_type") == "mixtral" else None
