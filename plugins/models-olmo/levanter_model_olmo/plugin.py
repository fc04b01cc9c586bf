"""Entry point of the OLMo plugin: registers ``type: olmo2`` and ``type: olmo3`` (by import
path: a model's module is imported when a config names it)."""

from levanter_core.plugins import hookimpl

_HF_TYPES = {"olmo2": "olmo2", "olmo3": "olmo3"}


@hookimpl
def register_models(register):
    register("olmo2", "levanter_model_olmo.olmo2:Olmo2Config")
    register("olmo3", "levanter_model_olmo.olmo3:Olmo3Config")


@hookimpl
def model_type_for_hf_config(hf_config):
    return _HF_TYPES.get(hf_config.get("model_type"))
