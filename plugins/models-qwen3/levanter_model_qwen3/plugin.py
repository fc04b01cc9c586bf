"""Entry point of the Qwen plugin (see ``pyproject.toml``): registers ``type: qwen`` and
``type: qwen3``, and claims Hugging Face checkpoints of the matching architectures.

The model modules are imported inside the hooks, not here, so that loading the plugin
(which every ``levanter`` command does) stays cheap.
"""

from levanter_core.plugins import hookimpl

# Hugging Face config.json `model_type` -> our registered type name
_HF_MODEL_TYPES = {"qwen2": "qwen", "qwen3": "qwen3"}


@hookimpl
def register_models(register):
    from levanter_model_qwen3.qwen import QwenConfig
    from levanter_model_qwen3.qwen3 import Qwen3Config

    register("qwen", QwenConfig)
    register("qwen3", Qwen3Config)


@hookimpl
def model_type_for_hf_config(hf_config):
    return _HF_MODEL_TYPES.get(hf_config.get("model_type"))
