"""Hugging Face datasets for levanter-core: the ``type: hf`` data source.

``HfSourceConfig`` is imported on first access, so that loading the plugin stays cheap."""

__all__ = ["HfSourceConfig"]


def __getattr__(name: str):
    if name == "HfSourceConfig":
        from levanter_data_hf.source import HfSourceConfig

        return HfSourceConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
