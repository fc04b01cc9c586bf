"""Hugging Face datasets for levanter-core: the ``type: hf`` data source."""

from levanter_data_hf.source import HfSourceConfig

__all__ = ["HfSourceConfig"]
