"""Entry point of the Llama plugin: registers ``type: llama`` and ``type: mistral``."""

from levanter_core.plugins import hookimpl

_HF_TYPES = {"llama": "llama", "mistral": "mistral"}


@hookimpl
def register_models(register):
    register("llama", "levanter_model_llama.llama:LlamaConfig")
    register("mistral", "levanter_model_llama.mistral:MistralConfig")


@hookimpl
def model_type_for_hf_config(hf_config):
    return _HF_TYPES.get(hf_config.get("model_type"))
