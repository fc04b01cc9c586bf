"""Entry point of the Llama plugin: registers ``type: llama``, ``type: mistral`` and ``type: phi3``."""

from levanter_core.plugins import hookimpl

_HF_TYPES = {"llama": "llama", "mistral": "mistral", "phi3": "phi3"}


@hookimpl
def register_models(register):
    register("llama", "levanter_model_llama.llama:LlamaConfig")
    register("mistral", "levanter_model_llama.mistral:MistralConfig")
    register("phi3", "levanter_model_llama.phi3:Phi3Config")


@hookimpl
def model_type_for_hf_config(hf_config):
    return _HF_TYPES.get(hf_config.get("model_type"))
