"""Entry point of the Gemma plugin: registers ``type: gemma``, ``gemma2`` and ``gemma3``."""

from levanter_core.plugins import hookimpl

# Hugging Face model_type -> our type. The multimodal "gemma3" is claimed so that importing
# it fails with an explanation (see Gemma3Config.hf_fields) rather than "no plugin handles it".
_HF_TYPES = {"gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3"}


@hookimpl
def register_models(register):
    register("gemma", "levanter_model_gemma.gemma:GemmaConfig")
    register("gemma2", "levanter_model_gemma.gemma2:Gemma2Config")
    register("gemma3", "levanter_model_gemma.gemma3:Gemma3Config")


@hookimpl
def model_type_for_hf_config(hf_config):
    return _HF_TYPES.get(hf_config.get("model_type"))
