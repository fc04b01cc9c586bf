"""Entry point of the Qwen plugin (see ``pyproject.toml``): registers ``type: qwen``,
``type: qwen3`` and ``type: qwen3_moe``, and claims Hugging Face checkpoints of the matching
architectures.

Types are registered by import path, so that loading the plugin (which every ``levanter``
command does) imports no model code; a model's module is imported when a config names it.
"""

from levanter_core.plugins import hookimpl

# Hugging Face config.json `model_type` -> our registered type name
_HF_MODEL_TYPES = {"qwen2": "qwen", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}


@hookimpl
def register_models(register):
    register("qwen", "levanter_model_qwen3.qwen:QwenConfig")
    register("qwen3", "levanter_model_qwen3.qwen3:Qwen3Config")
    register("qwen3_moe", "levanter_model_qwen3.qwen3_moe:Qwen3MoeConfig")


@hookimpl
def model_type_for_hf_config(hf_config):
    return _HF_MODEL_TYPES.get(hf_config.get("model_type"))
