"""Entry point of the gpt-oss plugin: registers ``type: gpt_oss`` (by import path, so that
loading the plugin imports no model code) and claims Hugging Face ``gpt_oss`` checkpoints."""

from levanter_core.plugins import hookimpl


@hookimpl
def register_models(register):
    register("gpt_oss", "levanter_model_gpt_oss.gpt_oss:GptOssConfig")


@hookimpl
def model_type_for_hf_config(hf_config):
    return "gpt_oss" if hf_config.get("model_type") == "gpt_oss" else None
