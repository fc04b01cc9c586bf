"""Entry point of the OLMo plugin: registers ``type: olmo2``."""

from levanter_core.plugins import hookimpl

@hookimpl
def register_models(register):
    register("olmo2", "levanter_model_olmo.olmo2:Olmo2Config")


@hookimpl
def model_type_for_hf_config(hf_config):
    return "olmo2" if hf_config.get("model_type") == "olmo2" else None
