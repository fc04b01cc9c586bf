import os

# Set before `datasets` is imported: every test runs as on a machine without network.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import datasets  # noqa: E402
import pytest  # noqa: E402

from levanter_data_hf import source  # noqa: E402


@pytest.fixture(autouse=True)
def private_hf_cache(tmp_path, monkeypatch):
    """Each test prepares datasets in its own Hugging Face cache and loads them afresh."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))  # for tokenizing worker processes
    source._load.cache_clear()
    yield
    source._load.cache_clear()
