"""Entry point of the GPT-2 plugin: registers ``type: gpt2`` and ``type: gpt2_hyena``."""

from levanter_core.plugins import hookimpl


@hookimpl
def register_models(register):
    register("gpt2", "levanter_model_gpt2.gpt2:Gpt2Config")
    register("gpt2_hyena", "levanter_model_gpt2.hyena:Gpt2HyenaConfig")


@hookimpl
def model_type_for_hf_config(hf_config):
    if hf_config.get("model_type") == "gpt2":
        return "gpt2"
    return None
