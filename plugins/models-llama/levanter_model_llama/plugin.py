"""Entry point of the Llama plugin: registers ``type: llama`` and ``type: mistral``."""

from levanter_core.plugins import hookimpl

_HF_TYPES = {"llama": "llama", "mistral": "mistral"}


@hookimpl
def register_models(register):
    from levanter_model_llama.llama import LlamaConfig
    from levanter_model_llama.mistral import MistralConfig

    register("llama", LlamaConfig)
    register("mistral", MistralConfig)


@hookimpl
def model_type_for_hf_config(hf_config):
    return _HF_TYPES.get(hf_config.get("model_type"))
