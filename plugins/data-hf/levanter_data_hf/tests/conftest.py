import datasets
import pytest

from levanter_data_hf import loading


@pytest.fixture(autouse=True)
def offline_private_hf_cache(tmp_path, monkeypatch):
    """Every test runs as on a machine without network, and prepares datasets in its own
    Hugging Face cache, loading them afresh (the environment reaches the tokenizing workers)."""
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    loading.load.cache_clear()
    yield
    loading.load.cache_clear()
