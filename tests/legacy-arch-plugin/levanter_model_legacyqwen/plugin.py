from levanter_core.plugins import hookimpl


@hookimpl
def register_models(register):
    # a class object, as the old guide showed (the string form is newer)
    from levanter_model_legacyqwen.model import LegacyQwenConfig

    register("legacy_qwen", LegacyQwenConfig)
