"""Entry point of the DeepSeek plugin: registers ``type: deepseek_v3`` (by import path, so that
loading the plugin imports no model code) and claims Hugging Face ``deepseek_v3`` checkpoints."""

from levanter_core.plugins import hookimpl


@hookimpl
def register_models(register):
    register("deepseek_v3", "levanter_model_deepseek.deepseek_v3:DeepseekV3Config")


@hookimpl
def model_type_for_hf_config(hf_config):
    return "deepseek_v3" if hf_config.get("model_type") == "deepseek_v3" else None
